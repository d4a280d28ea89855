"""``python -m pagedllm``: the same as the ``pagedllm`` command."""

import sys

from pagedllm.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
