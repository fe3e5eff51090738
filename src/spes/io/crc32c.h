// CRC-32C (Castagnoli, the polynomial 0x1EDC6F41 reflected), as TFRecord files frame their
// records with it, and TFRecord's masked form of it. Table driven, one byte at a time: the
// records it checks are small (TensorBoard events).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace spes {

uint32_t crc32c(std::string_view data);
// TFRecord's mask: rotated right by 15 bits plus 0xa282ead8 (a CRC of data that holds CRCs).
uint32_t masked_crc32c(std::string_view data);

}  // namespace spes
