"""llmserve: an LLM serving stack (engine, Triton adapter, HTTP front end)."""

import os as _os
import warnings as _warnings

# Paddle logs through glog and warns about ccache at import: keep the CLI's output clean.
_os.environ.setdefault("GLOG_minloglevel", "2")
_warnings.filterwarnings("ignore", message="No ccache found")

__version__ = "0.1.0"
