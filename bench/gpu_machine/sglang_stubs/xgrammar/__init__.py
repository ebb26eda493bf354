"""Stand-in (reflow bench/gpu_machine/sglang_stubs): not xgrammar. SGLang 0.5.17 imports these names at module
level only in sglang/srt/function_call/kimik3_structural_tag.py (Kimi-K3 tool-call tags, built inside functions).
Anything that instantiates one raises; the server runs with --grammar-backend none."""
from xgrammar.structural_tag import StructuralTag  # noqa: F401
