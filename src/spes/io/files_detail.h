// The write system call of io/files.h's file_write_direct made replaceable, for the tests of its
// fallback: a file system that opens a file with O_DIRECT and then refuses the direct writes
// (EINVAL) gets the file through the page cache instead; any other failure is an error. No
// other code should need this header.
#pragma once
#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <string>

namespace spes::detail {

// Writes up to n bytes of data at fd's position, as write(2): the count written, or -1 with
// errno set.
using WriteCall = std::function<ssize_t(int fd, const void* data, size_t n)>;

// file_write_direct (files.h) with every piece written through `write_call` (the amended head
// is written with pwrite(2) as always).
void file_write_direct_with(const std::string& path,
                            const std::function<void(std::string* buf)>& next,
                            const std::function<void(std::string* head)>& amend_head,
                            const WriteCall& write_call);

}  // namespace spes::detail
