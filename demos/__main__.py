"""``python -m demos --api-url URL``: the Gradio demo (see :mod:`demos.cli`)."""

from demos.cli import main

raise SystemExit(main())
