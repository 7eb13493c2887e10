"""ncclwatch: find the rank at fault when a distributed PyTorch job hangs.

The daemon side (this package) never imports torch: it watches processes and
reads the files they leave.
"""

__version__ = "0.1.0"
