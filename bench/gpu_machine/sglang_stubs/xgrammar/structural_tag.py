"""Stand-in names of xgrammar.structural_tag (see the package docstring)."""


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"xgrammar stand-in (reflow sglang_stubs): {type(self).__name__} needs the real xgrammar")


_NAMES = ["StructuralTag", "Format", "AnyTextFormat", "AnyTokensFormat", "ConstStringFormat", "ExcludeTokenFormat",
          "JSONSchemaFormat", "OptionalFormat", "OrFormat", "RegexFormat", "SequenceFormat", "StarFormat", "TagFormat",
          "TagsWithSeparatorFormat", "TokenFormat", "TriggeredTagsFormat"]
for _name in _NAMES:
    globals()[_name] = type(_name, (_Unavailable,), {"__module__": __name__})
__all__ = list(_NAMES)
