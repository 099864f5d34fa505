"""The sampling table and what it drives: the protocol's fields, models.toml, the CLI,
the dialects' names, docs/models.md's table, and each parameter's effect through the real
engine (the tiny GGUF on llama.cpp)."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from enginehelp import Collector

import everycycle
from everycycle.engine.core.jobs import Job, JobSpec, Sampling
from everycycle.engine.worker.runner import Runner
from everycycle.errors import ConfigError, InvalidRequestError, ProtocolError
from everycycle.models.registry import load_registry
from everycycle.protocol import Format, Generate, decode_request, encode, sampling
from everycycle.protocol.sampling import Bias

README = Path(everycycle.__file__).parent.parent / "docs" / "models.md"
SAMPLE = {"int": 3, "float": 0.5, "strings": ("x", "y"), "biases": (Bias(7, -5.0),)}


# --------------------------------------------------------------------------- the table

def test_the_readme_table_is_the_table() -> None:
    text = README.read_text()
    found = re.search(r"<!-- sampling-table[^>]*-->\n(.*?)<!-- /sampling-table -->", text,
                      re.DOTALL)
    assert found, "docs/models.md lost its sampling-table markers"
    assert found.group(1) == sampling.markdown(), (
        "docs/models.md's sampling table differs from the table; paste this:\n"
        + sampling.markdown())


def test_the_seeds_six_keep_their_wire_places_and_the_rest_are_extensions() -> None:
    fields = [f.name for f in dataclasses.fields(Generate)]
    seed = [n for n in fields if n in sampling.BY_NAME and n in
            {p.name for p in sampling.SEED_PARAMS}]
    assert seed == [p.name for p in sampling.SEED_PARAMS]
    assert fields[fields.index("max_tokens") + 1:fields.index("stop")] == seed
    extension = {f.name: f for f in dataclasses.fields(Generate)
                 if f.name in {p.name for p in sampling.EXTENSION_PARAMS}}
    assert set(extension) == {p.name for p in sampling.EXTENSION_PARAMS}
    assert all(f.metadata.get("skip_none") for f in extension.values())
    # Unset, an extension is absent from the line (the seed's Generate is unchanged).
    line = encode(Generate(request_id="r", model="m", prompt="x"))
    assert not any(p.name.encode() in line for p in sampling.EXTENSION_PARAMS)


@pytest.mark.parametrize("param", sampling.PARAMS, ids=lambda p: p.name)
def test_each_parameter_crosses_the_wire_and_is_range_checked(
        param: sampling.Param[object]) -> None:
    value = {"mirostat": 2, "samplers": ("top_k", "infill")}.get(param.name,
                                                               SAMPLE[param.kind])
    g = Generate(request_id="r", model="m", prompt="x", **{param.name: value})
    assert getattr(decode_request(encode(g)), param.name) == value
    assert sampling.values_of(g) == {param.name: value}
    if param.bounded:
        with pytest.raises(ProtocolError, match=f"{param.name} must be between"):
            Generate(request_id="r", model="m", prompt="x", **{param.name: param.high + 1})


def test_list_parameters_are_bounded() -> None:
    with pytest.raises(ProtocolError, match="at most 16 strings"):
        Generate(request_id="r", model="m", prompt="x", dry_sequence_breakers=("a",) * 17)
    with pytest.raises(ProtocolError, match="bias must be between -100 and 100"):
        Bias(1, 101.0)


def test_each_dialect_takes_the_names_the_table_gives_it() -> None:
    body = {p.name: SAMPLE[p.kind] if p.kind not in ("biases", "strings") else None
            for p in sampling.PARAMS}
    body.update(logit_bias={"7": -5}, dry_sequence_breakers=["x"], samplers=["top_k"])
    for dialect in sampling.DIALECTS:
        taken = sampling.from_json(dialect, body)
        assert set(taken) == {p.name for p in sampling.PARAMS if dialect in p.dialects}
    assert sampling.from_json(sampling.OPENAI, {"logit_bias": {"7": -5}}) == {
        "logit_bias": (Bias(7, -5.0),)}
    assert sampling.from_json(sampling.OPENAI, {"logit_bias": [[7, -5]]}) == {
        "logit_bias": (Bias(7, -5.0),)}
    assert sampling.from_json(sampling.OLLAMA, {"seed": -1}) == {}  # random
    with pytest.raises(ProtocolError, match="options.top_k must be an integer"):
        sampling.from_json(sampling.OLLAMA, {"top_k": 1.5}, "options.")
    with pytest.raises(ProtocolError, match="presence_penalty must be a number"):
        sampling.from_json(sampling.OPENAI, {"presence_penalty": True})
    with pytest.raises(ProtocolError, match="'x' is not a token id"):
        sampling.from_json(sampling.OPENAI, {"logit_bias": {"x": 1}})


def test_samplers_take_llama_servers_names_letters_and_aliases() -> None:
    def read(value: object) -> object:
        return sampling.checked(sampling.from_json(sampling.OPENAI, {"samplers": value}))

    assert read(["top_k", "top_p", "infill"]) == {"samplers": ("top_k", "top_p", "infill")}
    assert read("kpit") == {"samplers": ("top_k", "top_p", "infill", "temperature")}
    assert read(["Top-K", "nucleus", "temp", "typ-p", "minp"]) == {
        "samplers": ("top_k", "top_p", "temperature", "typ_p", "min_p")}
    # Names llama-server does not know are left out, as it leaves them (SillyTavern's).
    assert read(["top_k", "tfs_z", "typical_p", "temperature"]) == {
        "samplers": ("top_k", "temperature")}
    assert read("kz") == {"samplers": ("top_k",)}
    name, value = sampling.from_text("samplers", "Top-K,bogus")  # (the CLI's -o)
    with pytest.raises(ProtocolError, match="samplers: 'bogus' is not one"):
        sampling.checked({name: value})


def test_models_toml_takes_every_parameter_from_the_table(tmp_path: Path) -> None:
    f = tmp_path / "models.toml"
    f.write_text('[models.x]\npath = "m.gguf"\npresence_penalty = 0.5\nmirostat = 2\n'
                 'logit_bias = { "12" = -100 }\ndry_sequence_breakers = ["\\n"]\n')
    assert load_registry(f).get("x").sampling == {
        "presence_penalty": 0.5, "mirostat": 2, "logit_bias": (Bias(12, -100.0),),
        "dry_sequence_breakers": ("\n",)}
    f.write_text('[models.x]\npath = "m.gguf"\nxtc_threshold = 2\n')
    with pytest.raises(ConfigError, match=r"\[models.x\].xtc_threshold must be between 0 "
                       r"and 1"):
        load_registry(f)


def test_the_cli_reads_o_name_value_by_the_table() -> None:
    assert sampling.from_text("top-n-sigma", "1.5") == ("top_n_sigma", 1.5)
    assert sampling.from_text("logit_bias", '{"3": -100}') == ("logit_bias", (Bias(3, -100.0),))
    assert sampling.from_text("dry_sequence_breakers", "a,b") == (
        "dry_sequence_breakers", ("a", "b"))
    with pytest.raises(ProtocolError, match="unknown sampling option 'nope'"):
        sampling.from_text("nope", "1")
    with pytest.raises(ProtocolError, match="mirostat must be an integer"):
        sampling.from_text("mirostat", "x")


# ------------------------------------------------------- each one's effect, on llama.cpp

@pytest.fixture(scope="module")
def engine(tiny_gguf: Path) -> Iterator[tuple[Runner, Collector]]:
    collector = Collector()
    r = Runner(tiny_gguf, context=256, parallel=2, notify=collector)
    yield r, collector
    r.close()


_tags = itertools.count()
HOT = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def ids(engine: tuple[Runner, Collector], n: int = 48, **values: object) -> list[int]:
    runner, collector = engine
    tag = next(_tags)
    runner.submit(Job(JobSpec(tokens=runner.tokenize("the", Format.RAW), max_tokens=n,
                              sampling=Sampling.of(**values)), tag=tag))
    return [i for o in collector.wait(tag) for i in o.ids]


@pytest.fixture(scope="module")
def greedy(engine: tuple[Runner, Collector]) -> list[int]:
    out = ids(engine, temperature=0.0)
    assert len(out) == 48 and len(set(out)) < len(out)  # it repeats itself
    return out


def test_logit_bias_bans_the_greedy_first_token_and_forces_another(
        engine: tuple[Runner, Collector], greedy: list[int]) -> None:
    banned = ids(engine, temperature=0.0, logit_bias=(Bias(greedy[0], -100.0),))
    assert banned[0] != greedy[0] and greedy[0] not in banned[:1]
    forced = ids(engine, n=8, temperature=0.0, logit_bias=(Bias(42, 100.0),))
    assert forced == [42] * 8
    runner, _ = engine
    with pytest.raises(InvalidRequestError, match="token 99999 is not in this model's"):
        runner.submit(Job(JobSpec(tokens=[1, 2], max_tokens=2,
                                  sampling=Sampling.of(logit_bias=(Bias(99999, 1.0),)))))


@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty"])
def test_a_large_penalty_removes_repetitions_greedy_has(
        engine: tuple[Runner, Collector], greedy: list[int], name: str) -> None:
    penalised = ids(engine, temperature=0.0, **{name: 2.0})
    assert len(set(penalised)) > len(set(greedy))


def test_repeat_last_n_0_turns_the_penalties_off(
        engine: tuple[Runner, Collector], greedy: list[int]) -> None:
    assert ids(engine, temperature=0.0, repeat_penalty=5.0) != greedy
    assert ids(engine, temperature=0.0, repeat_penalty=5.0, repeat_last_n=0) == greedy


def test_typical_p_near_0_keeps_one_candidate_whatever_the_seed(
        engine: tuple[Runner, Collector]) -> None:
    assert ids(engine, **HOT, seed=1) != ids(engine, **HOT, seed=2)
    assert ids(engine, **HOT, seed=1, typical_p=0.001) == ids(engine, **HOT, seed=2,
                                                              typical_p=0.001)


def test_top_n_sigma_near_0_keeps_only_the_top_logit(
        engine: tuple[Runner, Collector], greedy: list[int]) -> None:
    for seed in (1, 2):
        assert ids(engine, **HOT, seed=seed, top_n_sigma=0.001) == greedy


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_with_no_surprise_allowed_is_greedy(
        engine: tuple[Runner, Collector], greedy: list[int], version: int) -> None:
    for seed in (1, 2):
        assert ids(engine, **HOT, seed=seed, mirostat=version, mirostat_tau=0.0) == greedy


def test_dry_breaks_the_repetitions_greedy_makes(
        engine: tuple[Runner, Collector], greedy: list[int]) -> None:
    dry = {"temperature": 0.0, "dry_multiplier": 5.0, "dry_allowed_length": 1}
    changed = ids(engine, **dry)
    assert changed != greedy and len(set(changed)) > len(set(greedy))
    assert ids(engine, **{**dry, "dry_base": 0.5}) == greedy  # (a base under 1: off)
    assert ids(engine, **{**dry, "dry_allowed_length": 1000}) == greedy
    assert ids(engine, **{**dry, "dry_penalty_last_n": 0}) == greedy


def test_xtc_excludes_the_top_choices(engine: tuple[Runner, Collector],
                                      greedy: list[int]) -> None:
    xtc = ids(engine, temperature=0.0, xtc_probability=1.0, xtc_threshold=0.01)
    assert xtc[0] != greedy[0]
    assert ids(engine, temperature=0.0, xtc_probability=1.0, xtc_threshold=0.6) == greedy
    assert ids(engine, temperature=0.0, xtc_probability=0.0, xtc_threshold=0.01) == greedy


def test_plain_greedy_is_the_one_rule() -> None:
    assert Sampling.of(temperature=0.0).plain_greedy
    assert not Sampling.of(temperature=0.0, presence_penalty=0.5).plain_greedy
    assert not Sampling.of(temperature=0.0, logit_bias=(Bias(1, 1.0),)).plain_greedy
    assert Sampling.of(temperature=0.0, typical_p=0.5, top_k=3).plain_greedy
    assert not Sampling.of().plain_greedy
    with pytest.raises(TypeError, match="no sampling parameter nope"):
        Sampling.of(nope=1)
