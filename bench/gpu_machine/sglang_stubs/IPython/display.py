"""Stand-in for the two names sglang/utils.py imports at module level (notebook helpers, unused by the server)."""


class HTML:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("IPython stand-in (reflow sglang_stubs): IPython is not installed")


def display(*args, **kwargs):
    raise RuntimeError("IPython stand-in (reflow sglang_stubs): IPython is not installed")
