"""The toolkit command line with every chunk write slowed down, so that a test can
interrupt a conversion in the middle of writing: after the first chunk is written the
file named by $SLOW_FLAG appears, and each chunk then takes $SLOW_SECONDS longer.

    SLOW_FLAG=/tmp/flag python tests/support/convert_slow_cli.py convert hf-to-megatron HF OUT ...
"""
from __future__ import annotations

import os
import sys
import time

from converters import sink
from toolkit.cli import main

_write = sink.KernelCopy.write


def slow_write(self, fd, chunk, offset):
    _write(self, fd, chunk, offset)
    open(os.environ["SLOW_FLAG"], "a").close()
    time.sleep(float(os.environ.get("SLOW_SECONDS", "0.05")))


if __name__ == "__main__":
    sink.KernelCopy.write = slow_write
    sys.exit(main(sys.argv[1:]))
