# Independent reference of the sync protocol's transport checksums (src/spes/sync/wire/checksum.h):
# the python-xxhash package from PyPI (its own bundled build of xxHash) prints the hex XXH3-128
# of each file named on the command line, one per line.
#   xxh3_reference.py FILE...
import sys

import xxhash

for path in sys.argv[1:]:
    with open(path, "rb") as f:
        print(xxhash.xxh3_128_hexdigest(f.read()))
