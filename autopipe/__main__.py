"""``python -m autopipe``: the command line, with steady CPU memory for its measurements."""
from ._allocator import steady_memory

steady_memory()  # before torch is imported: see autopipe._allocator

from .cli import main  # noqa: E402

raise SystemExit(main())
