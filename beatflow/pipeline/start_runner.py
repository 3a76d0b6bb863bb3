"""``python -m beatflow.pipeline.start_runner``: a runner of ``beatflow serve``
(:func:`beatflow.pipeline.runner.main`; the runner's module itself is not run as ``__main__``)."""
import sys

from beatflow.pipeline.runner import main

if __name__ == "__main__":
    sys.exit(main())
