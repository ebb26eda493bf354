"""Stand-in names of xgrammar.structural_tag (see the package docstring)."""


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"xgrammar stand-in (reflow sglang_stubs): {type(self).__name__} needs the real xgrammar")

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        """SGLang 0.5.17's request models name StructuralTag in a pydantic union: any value validates here (a
        request that sends one fails later, when the grammar backend - none on this path - would use it)."""
        from pydantic_core import core_schema

        return core_schema.any_schema()


_NAMES = ["StructuralTag", "Format", "AnyTextFormat", "AnyTokensFormat", "ConstStringFormat", "ExcludeTokenFormat",
          "JSONSchemaFormat", "OptionalFormat", "OrFormat", "RegexFormat", "SequenceFormat", "StarFormat", "TagFormat",
          "TagsWithSeparatorFormat", "TokenFormat", "TriggeredTagsFormat"]
for _name in _NAMES:
    globals()[_name] = type(_name, (_Unavailable,), {"__module__": __name__})
__all__ = list(_NAMES)
