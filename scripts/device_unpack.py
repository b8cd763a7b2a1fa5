"""Unpack what scripts/device_wheels.sh packed beside the wheels: the cut-down nvidia-pytriton into SITE
and numpy<2 for the Triton stub into STUB_SITE. Usage: device_unpack.py SITE STUB_SITE WHL_DIR"""

import sys
import tarfile
from pathlib import Path

for name, dest in (("pytriton-min.tar.xz", sys.argv[1]), ("stub-numpy.tar.xz", sys.argv[2])):
    p = Path(sys.argv[3]) / name
    if p.is_file():
        with tarfile.open(p) as t:
            t.extractall(dest, **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
        print(f"unpacked {name} into {dest}")
