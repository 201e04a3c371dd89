"""
A check both Hugging Face test files make: loading our export into transformers prints no warning. The block under
`with loads_without_warnings():` runs with warnings and transformers' log records collected; at its end any of them
fails the test, listed.
"""

import contextlib
import logging
import warnings


@contextlib.contextmanager
def loads_without_warnings():
    import transformers

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = transformers.logging.get_logger()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        logger.removeHandler(handler)
    problems = [r.getMessage() for r in records if r.levelno >= logging.WARNING] + [str(w.message) for w in caught]
    assert not problems, problems
