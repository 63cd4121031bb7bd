"""The llama.cpp peer (peers.llama_cpp, peers.llama_cpp_build, the benchmarks/llama_cpp.py command line)
without llama.cpp or a model: its parsers on output captured from real runs
(llama.cpp 0.5.0-dev, commit 0c1e570, from the llama-cpp-python 0.3.36 sdist), flag probing and one run
through fake binaries, the skip line without binaries, and the refusal of bad arguments."""

from __future__ import annotations

import json
import math
import stat
import sys
from pathlib import Path

import pytest

from engine.backends.models import load_pair
from evaluation.config import EvalConfig
from evaluation.eval_setup import Setup
from peers import llama_cpp as lc
from peers import llama_cpp_build as lcb
from peers.llama_peer import LlamaPeer
from tests_evaluation_helpers import load_benchmark

# Captured verbatim (stderr, with llama.cpp's timestamp prefixes): llama-completion -n 32, 2 threads.
COMPLETION_STDERR = """\
0.02.564.621 I generate: n_ctx = 2048, n_batch = 2048, n_predict = 32, n_keep = 0
0.13.327.999 I common_perf_print:    sampling time =       5.24 ms
0.13.328.041 I common_perf_print:    samplers time =       1.91 ms /    71 tokens
0.13.328.078 I common_perf_print:        load time =    2260.95 ms
0.13.328.115 I common_perf_print: prompt eval time =    3113.51 ms /    39 tokens (   79.83 ms per token,    \
12.53 tokens per second)
0.13.328.149 I common_perf_print:        eval time =    7633.36 ms /    31 runs   (  246.24 ms per token,     \
4.06 tokens per second)
0.13.328.184 I common_perf_print:       total time =   10764.09 ms /    70 tokens
0.13.328.218 I common_perf_print: unaccounted time =      11.98 ms /   0.1 %      (total - sampling - prompt eval \
- eval) / (total)
0.13.328.252 I common_perf_print:    graphs reused =         30
"""

# Captured verbatim: llama-speculative-simple -n 32 --spec-draft-n-max 8 --spec-draft-p-min 0.75.
SPECULATIVE_STDERR = """\
0.04.681.112 I encoded   39 tokens in    0.577 seconds, speed:   67.559 t/s
0.04.681.135 I decoded   41 tokens in    2.272 seconds, speed:   18.049 t/s
0.04.681.155 I 
0.04.681.177 I n_draft   = 8
0.04.681.196 I n_predict = 41
0.04.681.216 I n_drafted = 34
0.04.681.236 I n_accept  = 31
0.04.681.256 I accept    = 91.176%
0.04.681.275 I 
0.04.681.294 I draft:

0.04.681.353 I 
0.04.681.373 I target:

0.04.681.395 I common_perf_print:    sampling time =       6.51 ms
0.04.681.415 I common_perf_print:    samplers time =       2.00 ms /    41 tokens
0.04.681.435 I common_perf_print:        load time =     899.53 ms
0.04.681.455 I common_perf_print: prompt eval time =    1530.75 ms /    83 tokens (   18.44 ms per token,    \
54.22 tokens per second)
0.04.681.475 I common_perf_print:        eval time =      48.83 ms /     1 runs   (   48.83 ms per token,    \
20.48 tokens per second)
0.04.681.496 I common_perf_print:       total time =    3228.96 ms /    84 tokens
"""  # noqa: W291 (llama.cpp prints "I " on its empty lines)

VERSION_STDERR = "version: 0.5.0-dev (build 1, commit 0c1e570)\nbuilt with GNU 12.2.0 for Linux x86_64\n"

# Lines of the real --help of llama-speculative-simple / llama-completion that the probing reads.
SPECULATIVE_HELP = """\
-tb,   --threads-batch N                number of threads to use during batch and prompt processing (default:
--spec-draft-threads, -td, --threads-draft N
--spec-draft-threads-batch, -tbd, --threads-batch-draft N
--spec-draft-n-max N                    number of tokens to draft for speculative decoding (default: 3)
--spec-draft-p-min, --draft-p-min P     minimum speculative decoding probability (greedy) (default: 0.00)
--spec-type none,draft-simple,draft-eagle3,draft-mtp,draft-dflash,draft-dspark,ngram-simple,ngram-map-k
--spec-ngram-simple-size-n N            ngram size N for ngram-simple speculative decoding, length of lookup
"""
COMPLETION_HELP = """\
--display-prompt, --no-display-prompt   whether to print prompt at generation (default: true)
-cnv,  --conversation, -no-cnv, --no-conversation
"""


@pytest.fixture(scope="module")
def script():
    return load_benchmark("llama_cpp")


def test_parses_completion_timings():
    got = lc.parse_completion_output(COMPLETION_STDERR)
    assert got["decode_runs"] == 31 and got["tokens"] == 32
    assert got["decode_s"] == pytest.approx(7.63336)
    assert (
        got["tok_s"] == pytest.approx(31 / 7.63336) and round(got["tok_s"], 2) == 4.06
    )  # llama.cpp's figure
    assert got["prompt_tokens"] == 39 and got["prompt_s"] == pytest.approx(3.11351)
    assert got["total_s"] == pytest.approx(10.76409)


def test_parses_speculative_timings_and_acceptance():
    got = lc.parse_speculative_output(SPECULATIVE_STDERR)
    assert got["tokens"] == 41 and got["decode_s"] == pytest.approx(2.272)
    assert got["tok_s"] == pytest.approx(41 / 2.272) and round(got["tok_s"], 3) == 18.046
    assert got["prompt_tokens"] == 39 and got["prompt_s"] == pytest.approx(0.577)
    assert (got["n_draft"], got["n_drafted"], got["n_accept"]) == (8, 34, 31)
    assert got["accept"] == pytest.approx(31 / 34) and "n_predict" not in got


def test_parsers_refuse_output_without_timings():
    with pytest.raises(lc.LlamaCppRunError, match="eval time"):
        lc.parse_completion_output("0.01.0 E failed to load model\n")
    with pytest.raises(lc.LlamaCppRunError, match="decoded"):
        lc.parse_speculative_output(COMPLETION_STDERR)  # perf lines alone are not a speculative result


def test_prompt_eval_line_is_not_read_as_decoding():
    only_prompt = "\n".join(
        line for line in COMPLETION_STDERR.splitlines() if " eval time" not in line or "prompt eval" in line
    )
    with pytest.raises(lc.LlamaCppRunError):
        lc.parse_completion_output(only_prompt)


def test_parses_version_and_nan():
    assert lcb.parse_version(VERSION_STDERR) == {"version": "0.5.0-dev", "build": 1, "commit": "0c1e570"}
    assert lcb.parse_version("no version here") == {}
    zero = "decoded    0 tokens in    0.000 seconds, speed:     -nan t/s\n"
    got = lc.parse_speculative_output(zero)
    assert got["tokens"] == 0 and math.isnan(got["tok_s"])


def _fake_binary(path: Path, help_text: str, stderr: str, stdout: str) -> None:
    """A stand-in for a llama.cpp program: --help / --version print text, any other call a captured run."""
    data = path.with_suffix(".data")
    data.mkdir()
    (data / "help").write_text(help_text)
    (data / "version").write_text(VERSION_STDERR)
    (data / "stderr").write_text(stderr)
    (data / "stdout").write_text(stdout)
    (data / "args").touch()
    path.write_text(f"""#!{sys.executable}
import json
import sys
d = {str(data)!r}
if sys.argv[1:] == ["--help"]:
    print(open(d + "/help").read())
elif sys.argv[1:] == ["--version"]:
    sys.stderr.write(open(d + "/version").read())
else:
    json.dump(sys.argv[1:], open(d + "/args", "w"))
    sys.stderr.write(open(d + "/stderr").read())
    sys.stdout.write(open(d + "/stdout").read())
""")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_bin(tmp_path) -> Path:
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    _fake_binary(
        tmp_path / "llama-completion", COMPLETION_HELP, COMPLETION_STDERR, "Hello there. [end of text]\n"
    )
    _fake_binary(
        tmp_path / "llama-speculative-simple",
        SPECULATIVE_HELP,
        SPECULATIVE_STDERR,
        f"\n\n{prompt}Hello there.\n\n",
    )
    return tmp_path


def test_probes_flags_and_runs_through_fake_binaries(fake_bin):
    binaries = lcb.find_binaries(fake_bin)
    assert binaries is not None
    assert binaries.draft_max_flag == "--spec-draft-n-max" and binaries.p_min_flag == "--spec-draft-p-min"
    assert binaries.draft_threads_flags == ("-td", "-tbd")
    assert binaries.completion_extra == ("-no-cnv", "--no-display-prompt")
    assert binaries.speculative_extra == ("--spec-type", "draft-simple")
    assert binaries.version["commit"] == "0c1e570"
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    ar = lc.run_llama_cpp(binaries, lc.AUTOREGRESSIVE, prompt, "t.gguf", max_new_tokens=32, threads=2)
    assert ar["setting"] == "autoregressive" and ar["tokens"] == 32 and ar["output"] == "Hello there."
    args = json.loads((fake_bin / "llama-completion.data" / "args").read_text())
    assert "--ignore-eos" not in args and "-md" not in args
    for flag, value in (("-n", "32"), ("--temp", "0"), ("--top-k", "1"), ("-t", "2"), ("-tb", "2")):
        assert args[args.index(flag) + 1] == value
    assert "-no-cnv" in args and args[args.index("-p") + 1] == prompt

    spec = lc.run_llama_cpp(
        binaries, lc.LlamaSetting(8, 0.75), prompt, "t.gguf", "d.gguf", max_new_tokens=32, threads=2
    )
    assert spec["setting"] == "spec n=8 p=0.75" and spec["n_max"] == 8 and spec["p_min"] == 0.75
    assert spec["tokens"] == 41 and spec["accept"] == pytest.approx(31 / 34)
    assert spec["output"] == "Hello there."  # the prompt echo is removed
    args = json.loads((fake_bin / "llama-speculative-simple.data" / "args").read_text())
    for flag, value in (
        ("-md", "d.gguf"),
        ("--spec-draft-n-max", "8"),
        ("--spec-draft-p-min", "0.75"),
        ("--spec-type", "draft-simple"),
        ("-td", "2"),
        ("-tbd", "2"),
    ):
        assert args[args.index(flag) + 1] == value
    assert "--ignore-eos" not in args


def test_a_failing_run_raises_a_clear_error(fake_bin):
    binaries = lcb.find_binaries(fake_bin)
    (fake_bin / "llama-completion.data" / "stderr").write_text("0.01 E error: unknown argument: -foo\n")
    with pytest.raises(lc.LlamaCppRunError, match="autoregressive: no 'eval time"):
        lc.run_llama_cpp(binaries, lc.AUTOREGRESSIVE, "x", "t.gguf")


def test_skips_without_binaries_when_building_is_off(script, tmp_path, capsys):
    rc = script.main(["--no-build", "--llama-bin", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("\n") == 1 and out.startswith("llama.cpp benchmark skipped:") and str(tmp_path) in out


@pytest.mark.parametrize(
    "extra",
    [
        ["--draft-max", "0,4"],
        ["--draft-max", "4,x"],
        ["--draft-p-min", "1.5"],
        ["--draft-p-min", ""],
        ["--threads", "0"],
        ["--languages", "fr"],
    ],
)
def test_refuses_bad_arguments(script, tmp_path, extra, capsys):
    with pytest.raises(SystemExit) as err:
        script.main(["--no-build", "--llama-bin", str(tmp_path), *extra])
    assert err.value.code == 2 and "error:" in capsys.readouterr().err


def test_grid_lists_parse(script):
    assert script._int_list("4, 8,16,8") == [4, 8, 16]
    assert script._prob_list("0,0.75") == [0.0, 0.75]
    assert lc.LlamaSetting(16, 0.0).name == "spec n=16 p=0" and lc.AUTOREGRESSIVE.name == "autoregressive"


# ------------------------------------------------------------------------- the evaluation's llama.cpp rows
def test_evaluation_llama_peer_runs_through_fake_binaries(fake_bin, tmp_path):
    """peers.llama_peer: one record per request with run_engine's keys, tokens re-encoded with our
    tokenizer, the speculative row given its --spec-draft-n-max / p-min."""
    pair = load_pair("tiny", device="cpu")
    binaries = _benchmark_find(fake_bin)
    peer = LlamaPeer(binaries, tmp_path / "t.gguf", tmp_path / "d.gguf", (16, 0.75), 2, pair)
    ar = peer.run("llama_cpp", "hello", 32, 0)
    assert ar["tokens"] == pair.encode("Hello there.", chat=False)
    assert ar["num_tokens"] > 1 and ar["decode_s"] > 0 and ar["cycles"] == []
    assert abs(ar["total_s"] - ar["ttft_s"] - ar["decode_s"]) < 1e-9
    spec = peer.run("llama_cpp_spec", "hello", 32, 0)
    assert spec["llama"]["accept"] is not None
    args = json.loads((fake_bin / "llama-speculative-simple.data" / "args").read_text())
    assert "16" in args and "0.75" in args
    assert "speculative" in peer.describe("llama_cpp_spec") and "autoregressive" in peer.describe("llama_cpp")


def _benchmark_find(bin_dir):
    return lcb.find_binaries(bin_dir)


@pytest.mark.parametrize("text", ["16", "0,0.5", "8,1.5", "a,b"])
def test_evaluation_refuses_a_bad_llama_setting(text):
    with pytest.raises(ValueError, match="llama_spec"):
        EvalConfig(llama_spec=text)


def test_evaluation_leaves_llama_rows_out_for_a_pair_without_gguf():
    setup = Setup(EvalConfig(pair="tiny", device="cpu", controllers="autoregressive,llama_cpp"))
    assert "llama_cpp" not in setup.names and any("GGUF" in w for w in setup.warnings)


def test_summary_reports_prefill_speed_where_every_run_has_it(script):
    runs = [
        {
            "setting": "autoregressive",
            "language": "en",
            "decode_runs": 99,
            "decode_s": 4.0,
            "tokens": 100,
            "tok_s": 24.75,
            "prompt_tokens": 2000,
            "prompt_s": 20.0,
        },
        {
            "setting": "autoregressive",
            "language": "it",
            "decode_runs": 49,
            "decode_s": 2.0,
            "tokens": 50,
            "tok_s": 24.5,
            "prompt_tokens": 1000,
            "prompt_s": 20.0,
        },
        # llama-speculative-simple prints no prompt count (-1): no prefill figure rather than a wrong one
        {
            "setting": "spec",
            "language": "en",
            "tokens": 100,
            "decode_s": 5.0,
            "tok_s": 20.0,
            "prompt_tokens": -1,
            "prompt_s": 1.0,
        },
    ]
    summary = script.summarize(runs, ["autoregressive", "spec"])
    assert summary["autoregressive"]["prefill_tok_s"] == 3000 / 40.0
    assert summary["spec"]["prefill_tok_s"] is None


def test_evaluation_llama_lookup_row_runs_ngram_simple_without_the_draft(fake_bin, tmp_path):
    pair = load_pair("tiny", device="cpu")
    binaries = _benchmark_find(fake_bin)
    assert binaries.ngram_simple
    peer = LlamaPeer(binaries, tmp_path / "t.gguf", tmp_path / "d.gguf", (16, 0.75), 2, pair, lookup=(2, 4))
    run = peer.run("llama_cpp_lookup", "hello", 32, 0)
    assert run["num_tokens"] > 1 and run["decode_s"] > 0
    args = json.loads((fake_bin / "llama-speculative-simple.data" / "args").read_text())
    assert args[args.index("--spec-type") + 1] == "ngram-simple" and "-md" not in args
    assert args[args.index("--spec-ngram-simple-size-n") + 1] == "2"
    assert args[args.index("--spec-ngram-simple-size-m") + 1] == "4"
    assert "ngram-simple" in peer.describe("llama_cpp_lookup")


def test_ngram_settings_parse_and_refuse(script):
    assert lc.parse_ngram("3:3") == (3, 3) and lc.parse_ngram("2,4") == (2, 4)
    assert script._ngram_list("2:2,3:4,2:2") == [(2, 2), (3, 4)]
    assert lc.LlamaSetting(ngram=(3, 3)).name == "lookup n=3 m=3"
    for bad in ("3:2", "0:1", "a:b", "3"):
        with pytest.raises(ValueError):
            lc.parse_ngram(bad)


@pytest.mark.parametrize("text", ["3:2", "x", "0:0"])
def test_evaluation_refuses_a_bad_llama_lookup_setting(text):
    with pytest.raises(ValueError, match="llama_lookup"):
        EvalConfig(llama_lookup=text)


def test_a_peer_that_crashes_on_its_warm_up_leaves_its_row_out(fake_bin, workdir, tiny_policy, monkeypatch):
    """A llama.cpp build that dies on this CPU (e.g. a kernel path the CPU lists but cannot run: a signal on
    the first request) costs the evaluation its llama.cpp row, with a warning, not the whole run; the other
    llama.cpp rows, whose program runs, stay."""
    import signal

    from test_evaluate_cli import small_eval

    completion = fake_bin / "llama-completion"
    lines = completion.read_text().splitlines()
    lines.insert(
        3,
        f"import os\nif sys.argv[1:] not in (['--help'], ['--version']): os.kill(os.getpid(), {int(signal.SIGSEGV)})",
    )
    completion.write_text("\n".join(lines) + "\n")

    def find(config, pair, threads):
        binaries = _benchmark_find(fake_bin)
        return LlamaPeer(binaries, fake_bin / "t.gguf", fake_bin / "d.gguf", (16, 0.75), threads, pair), None

    monkeypatch.setattr(LlamaPeer, "find", staticmethod(find))
    rc, stderr, res = small_eval(
        workdir, tiny_policy, "llama-crash", "autoregressive,llama_cpp,llama_cpp_spec", "--no-replay"
    )
    assert rc == 0, stderr
    assert "llama_cpp" not in res["summary"]["table"] and "llama_cpp_spec" in res["summary"]["table"]
    assert any(w.startswith("llama_cpp left out: llama.cpp failed its warm-up") for w in res["warnings"])


def _fake_compiler(path: Path, rc: int) -> str:
    path.write_text(f"#!/bin/sh\ncat > /dev/null\nexit {rc}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_the_build_leaves_amx_out_on_x86_where_the_compiler_can(tmp_path, monkeypatch):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    accepts, refuses = _fake_compiler(tmp_path / "ok++", 0), _fake_compiler(tmp_path / "old++", 1)
    flags = lcb.cmake_flags(accepts)
    assert flags[: len(lcb.CMAKE_FLAGS)] == lcb.CMAKE_FLAGS
    extra = " ".join(lcb.NO_AMX)
    assert f"-DCMAKE_C_FLAGS={extra}" in flags and f"-DCMAKE_CXX_FLAGS={extra}" in flags
    assert lcb.cmake_flags(refuses) == lcb.CMAKE_FLAGS  # a compiler without AMX flags: as before
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert lcb.cmake_flags(accepts) == lcb.CMAKE_FLAGS


def test_a_cached_build_with_other_flags_is_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(lcb, "cmake_flags", lambda cxx=None: ("-DA=1", "-DB=2"))
    assert lcb.stale_build(tmp_path) is None  # no BUILD_INFO.json: not built by the script
    info = tmp_path / "BUILD_INFO.json"
    info.write_text(json.dumps({"cmake_flags": ["-DA=1", "-DB=2"]}))
    assert lcb.stale_build(tmp_path) is None
    info.write_text(json.dumps({"cmake_flags": ["-DA=1"]}))
    assert "-DB=2 missing" in lcb.stale_build(tmp_path)
    info.write_text("{not json")
    assert lcb.stale_build(tmp_path) is None


def test_prefill_peer_skips_without_binaries(tmp_path, capsys):
    rc = load_benchmark("prefill_peer").main(["--llama-bin", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("\n") == 1 and out.startswith("skipped: no llama.cpp binaries") and str(tmp_path) in out


@pytest.mark.parametrize(
    "extra",
    [["--tokens", "0"], ["--tokens", "512,x"], ["--threads", "0"], ["--repeats", "0"], ["--pair", "nope"]],
)
def test_prefill_peer_refuses_bad_arguments(tmp_path, extra, capsys):
    with pytest.raises(SystemExit) as err:
        load_benchmark("prefill_peer").main(["--llama-bin", str(tmp_path), *extra])
    assert err.value.code == 2 and "error:" in capsys.readouterr().err
