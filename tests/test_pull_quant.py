"""Pulling a hub repo by quantization (`hf://owner/repo[:QUANT][@REV]`): the choice rules,
split GGUFs, `models add`'s pins and `rm --purge`, through the real huggingface-hub
client against the local fake hub."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonhelp import daemon_process, wait_until
from fakehub import FakeHub
from test_hub import COMMIT, ec, sha
from tinymodel import write_tiny_gguf
from tinyvision import write_tiny_mmproj

from everycycle import paths
from everycycle.errors import InvalidRequestError
from everycycle.models import hubrepo
from everycycle.models.hubrepo import Choice, RepoRef, choices, choose

SPLIT = [f"tiny-Q4_K_M-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]


def names(*files: str, size: int | None = 100) -> list[tuple[str, int | None]]:
    return [(f, size) for f in files]


def chosen(files: list[tuple[str, int | None]], quant: str | None = None) -> str:
    return choose(RepoRef("o/r", quant), choices(files), COMMIT).first


def test_the_choice_rules() -> None:
    many = names("m-Q2_K.gguf", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-F16.gguf", "README.md")
    assert chosen(many) == "m-Q4_K_M.gguf"  # the default
    assert chosen(many, "q8_0") == "m-Q8_0.gguf"  # a tag, in any case
    assert chosen(many, "F16") == "m-F16.gguf"
    # Without Q4_K_M: the fewest bits of at least 4, then the smaller file.
    assert chosen(names("m-Q3_K_M.gguf", "m-Q8_0.gguf", "m-Q5_K_S.gguf")) == "m-Q5_K_S.gguf"
    assert chosen([("m-Q4_0.gguf", 300), ("m-IQ4_XS.gguf", 200), ("m-Q6_K.gguf", 100)]
                  ) == "m-IQ4_XS.gguf"
    # Projectors are not models; a lone unnamed GGUF is the choice; folders count.
    assert chosen(names("mmproj-m-f16.gguf", "m.gguf")) == "m.gguf"
    assert chosen(names("Q4_K_M/m-Q4_K_M.gguf", "Q8_0/m-Q8_0.gguf")) == "Q4_K_M/m-Q4_K_M.gguf"
    assert hubrepo.quant_of("Llama-3.2-1B-Instruct-UD-Q4_K_XL.gguf") == "Q4_K_XL"
    with pytest.raises(InvalidRequestError, match=r"has no Q2_K GGUF \(it has F16, Q4_K_M\)"):
        chosen(names("m-F16.gguf", "m-Q4_K_M.gguf"), "Q2_K")
    with pytest.raises(InvalidRequestError, match="has no GGUF file"):
        chosen(names("README.md", "config.json", "mmproj-f16.gguf"))
    with pytest.raises(InvalidRequestError, match="no Q4_K_M or other GGUF of 4 bits"):
        chosen(names("a-Q2_K.gguf", "a-Q3_K_S.gguf"))


def test_split_ggufs_are_one_choice_with_every_part() -> None:
    [split] = choices([(n, 10) for n in reversed(SPLIT)])
    assert split == Choice(tuple(SPLIT), "Q4_K_M", 30)
    with pytest.raises(InvalidRequestError, match="split in 3 parts lacks part 2"):
        choices(names(SPLIT[0], SPLIT[2]))


def test_repo_urls_parse() -> None:
    assert hubrepo.parse_repo_url("hf://o/r") == RepoRef("o/r")
    assert hubrepo.parse_repo_url("hf://o/r:Q8_0@v1") == RepoRef("o/r", "Q8_0", "v1")
    assert hubrepo.parse_repo_url("hf://o/r/file.gguf") is None  # a file URL
    with pytest.raises(InvalidRequestError, match="not a revision"):
        hubrepo.parse_repo_url("hf://o/r@..")


@pytest.fixture
def quants(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[FakeHub]:
    """acme/quants: a Q8_0 file, a Q4_K_M split in 3 parts, a projector, a README;
    acme/docs: no GGUF at all."""
    (tmp_path / "split").mkdir()
    first = write_tiny_gguf(tmp_path / "split" / "tiny-Q4_K_M.gguf", split_max_tensors=8)
    server = FakeHub()
    for part in sorted(first.parent.iterdir()):
        server.add("acme/quants", COMMIT, part.name, part.read_bytes())
    server.add("acme/quants", COMMIT, "tiny-Q8_0.gguf", tiny_gguf.read_bytes())
    projector = write_tiny_mmproj(tmp_path / "mmproj-tiny-f16.gguf")
    server.add("acme/quants", COMMIT, projector.name, projector.read_bytes())
    server.add("acme/quants", COMMIT, "README.md", b"# tiny")
    server.add("acme/docs", COMMIT, "README.md", b"# words only")
    server.start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    yield server
    server.stop()


def test_pull_by_quantization(quants: FakeHub, tiny_gguf: Path) -> None:
    out = ec("pull", "hf://acme/quants")  # Q4_K_M by default: the split one
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path.name == SPLIT[0] and path.parts[-2] == COMMIT
    # Every part beside the first, and the repo's vision projector; nothing else.
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        [*SPLIT, "mmproj-tiny-f16.gguf"])
    q8 = ec("pull", "hf://acme/quants:q8_0")
    assert q8.returncode == 0, q8.stderr
    assert Path(q8.stdout.strip()).read_bytes() == tiny_gguf.read_bytes()
    for url, says in (("hf://acme/quants:Q2_K", "has no Q2_K GGUF (it has Q4_K_M, Q8_0)"),
                      ("hf://acme/docs", "has no GGUF file"),
                      ("hf://acme/nothing", "no such repository"),
                      ("hf://acme/quants@nope", "no such revision")):
        bad = ec("pull", url)
        assert bad.returncode == 2 and says in bad.stderr, (url, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


def test_models_add_by_quant_pins_it_runs_offline_and_rm_purge_deletes_it(
        quants: FakeHub, tiny_gguf: Path, tmp_path: Path) -> None:
    out = ec("models", "add", "mine", "hf://acme/quants:Q4_K_M", "--context", "256",
             "--parallel", "1")
    assert out.returncode == 0, out.stderr
    text = paths.user_models_file().read_text()
    assert f'hf_file = "{SPLIT[0]}"' in text and f'revision = "{COMMIT}"' in text
    cached = Path(ec("pull", "mine").stdout.strip())
    assert f'sha256 = "{sha(cached)}"' in text
    projector = cached.parent / "mmproj-tiny-f16.gguf"
    assert f'mmproj = "hf://acme/quants/mmproj-tiny-f16.gguf@{COMMIT}"' in text
    assert f'mmproj_sha256 = "{sha(projector)}"' in text
    quants.stop()  # no network from here on
    os.environ["HF_HUB_OFFLINE"] = "1"
    run = ec("run", "-m", "mine", "--no-daemon", "--offline", "-n", "6", "--temperature", "0",
             "hello")
    assert run.returncode == 0, run.stderr
    whole = ec("run", "-m", str(tiny_gguf), "--no-daemon", "-n", "6", "--temperature", "0",
               "hello")
    assert run.stdout == whole.stdout  # the same weights, split in three
    from PIL import Image

    Image.new("RGB", (16, 16), (250, 10, 10)).save(tmp_path / "red.png")
    seen = ec("run", "-m", "mine", "--no-daemon", "--offline", "-n", "4", "--image",
              str(tmp_path / "red.png"), "what is it?")
    assert seen.returncode == 0 and seen.stdout, seen.stderr  # its projector came along
    again = ec("pull", "hf://acme/quants:Q4_K_M")  # offline: chosen from the cache
    assert again.returncode == 0 and Path(again.stdout.strip()) == cached, again.stderr
    gone = ec("rm", "mine", "--purge")
    assert gone.returncode == 0, gone.stderr
    assert "deleted 4 file(s)" in gone.stderr
    assert not cached.exists() and not any(cached.parent.iterdir())
    assert "mine" not in paths.user_models_file().read_text()


def test_rm_purge_refuses_a_local_file_and_keeps_the_entry(tiny_gguf: Path) -> None:
    paths.user_models_file().parent.mkdir(parents=True, exist_ok=True)
    paths.user_models_file().write_text(f'[models.mine]\npath = "{tiny_gguf}"\n')
    out = ec("rm", "mine", "--purge")
    assert out.returncode == 2 and "deletes only files from the hub cache" in out.stderr
    assert "mine" in paths.user_models_file().read_text() and tiny_gguf.exists()


def test_run_with_a_hub_url_pulls_once_and_answers(quants: FakeHub, tiny_gguf: Path) -> None:
    first = ec("run", "-m", "hf://acme/quants:Q8_0", "--no-daemon", "-n", "6",
               "--temperature", "0", "hello")
    assert first.returncode == 0, first.stderr
    assert "as 'quants:q8_0'" in first.stderr and first.stdout
    entry = tomllib.loads(paths.user_models_file().read_text())["models"]["quants:q8_0"]
    assert entry["hf_file"] == "tiny-Q8_0.gguf" and entry["revision"] == COMMIT
    assert entry["sha256"] == sha(tiny_gguf)
    gets = sum(1 for method, _, _ in quants.requests if method == "GET")
    # The second time, through a daemon started before the entry existed: no pull.
    with daemon_process():
        again = ec("run", "-m", "hf://acme/quants:Q8_0", "-n", "6", "--temperature", "0",
                   "hello")
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout and again.stderr == ""
    assert sum(1 for method, _, _ in quants.requests if method == "GET") == gets


def test_a_hub_url_as_an_http_model_id_is_pulled_by_the_daemon(quants: FakeHub) -> None:
    import openai
    from httphelp import EventReader, fleet_http

    with daemon_process("--http", "127.0.0.1:0"), openai.OpenAI(
            base_url=f"{fleet_http()}/v1", api_key="unused", max_retries=0) as client:
        seen = EventReader(f"{fleet_http()}/v1/events?types=pull,request")
        try:
            for name in ("hf://acme/quants:Q8_0", "hf.co/acme/quants:Q8_0",
                         "hf://acme/quants:Q8_0"):
                r = client.completions.create(model=name, prompt="hello", max_tokens=4,
                                              temperature=0)
                assert r.choices[0].text
            wait_until(lambda: len(seen.of("request", state="finished")) == 3,
                       "the three requests' events")
            # One pull told, the first time; a URL recorded since is only looked up.
            pulls = seen.of("pull")
            assert {e["model"] for e in pulls} == {"hf://acme/quants:Q8_0"}
            assert pulls[0]["status"] == "pulling"
            assert [e["status"] for e in pulls if e["status"] != "pulling"] == ["done"]
        finally:
            seen.close()
        gets = sum(1 for method, _, _ in quants.requests if method == "GET")
        again = client.completions.create(model="quants:q8_0", prompt="hello",
                                          max_tokens=4, temperature=0)
        assert again.choices[0].text == r.choices[0].text
    entry = tomllib.loads(paths.user_models_file().read_text())["models"]["quants:q8_0"]
    assert entry["hf_file"] == "tiny-Q8_0.gguf"
    assert sum(1 for method, _, _ in quants.requests if method == "GET") == gets
