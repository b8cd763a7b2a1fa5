"""`python -m llmserve.http`: see llmserve.http.server."""

import sys

from llmserve.http.server import main

sys.exit(main())
