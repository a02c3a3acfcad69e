"""`consort bench`: benchmark scripts with a report (cli.py dispatches), never timed tests."""


class BenchError(Exception):
    """A benchmark that could not measure what it set out to (a server that never got ready, requests
    it would not answer): one line at the command boundary, not a traceback."""
