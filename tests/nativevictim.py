"""Not collected by the suite (its name is no test_*.py): test_nativeguard.py runs it in a
child pytest, where a load that asks for extra buffer types must die as on a CPU whose
AMX kernels fault, and the run's last line must name this test."""

from __future__ import annotations

from tinymodel import write_tiny_gguf


def test_a_load_with_extra_buffers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import llama_cpp

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = True  # against the verdict: what the guard is for
    llama_cpp.llama_model_load_from_file(str(path).encode(), params)
