"""llama.cpp as a peer in the evaluation: the same GGUF files, threads, prompts (chat template applied with
our tokenizer) and token budget, run prompt by prompt interleaved with our controllers.

Three rows: ``llama_cpp`` (its autoregressive decoding, ``llama-completion``), ``llama_cpp_spec`` (its
speculative decoding with the draft GGUF, ``llama-speculative-simple``, at ``EvalConfig.llama_spec``) and
``llama_cpp_lookup`` (its n-gram lookup drafting without a draft model, ``--spec-type ngram-simple`` at
``EvalConfig.llama_lookup``; left out with a warning where the build lacks it). The
programs are the ones ``benchmarks/llama_cpp.py`` builds and caches (the evaluation never builds them: it
says why and leaves the rows out when they, or the pair's GGUF files, are missing). Each run is one
subprocess; its timings are llama.cpp's own (prompt evaluation, then decoding), model loading excluded, as
our runs exclude loading. A measurement has the keys of ``evaluation.measurements.run_engine``; ``tokens``
are its output text re-encoded with our tokenizer (llama.cpp prints text, not ids), so token agreement
with our engine is approximate where a text has two tokenisations.
"""

from __future__ import annotations

from pathlib import Path

from engine.backends.files import cache_dir
from engine.backends.weights import DEFAULT_PAIRS, fetch_gguf
from peers.llama_cpp import AUTOREGRESSIVE, LlamaSetting, parse_ngram, run_llama_cpp
from peers.llama_cpp_build import default_bin_dir, find_binaries, stale_build

LLAMA_PEERS = ("llama_cpp", "llama_cpp_spec", "llama_cpp_lookup")


def parse_spec_setting(text: str) -> tuple[int, float]:
    """``"N,P"`` -> (draft max N >= 1, p-min P in [0, 1])."""
    try:
        n, p = text.split(",")
        n_max, p_min = int(n), float(p)
    except ValueError:
        raise ValueError(f"llama_spec must be 'N_MAX,P_MIN' (e.g. 16,0.75), got {text!r}") from None
    if n_max < 1 or not 0.0 <= p_min <= 1.0:
        raise ValueError(f"llama_spec: N_MAX must be >= 1 and P_MIN in [0, 1], got {text!r}")
    return n_max, p_min


def parse_lookup_setting(text: str) -> tuple[int, int]:
    """``"N:M"`` -> (N, M), 1 <= N <= M (``peers.llama_cpp.parse_ngram``)."""
    try:
        return parse_ngram(text)
    except ValueError as err:
        raise ValueError(f"llama_lookup: {err}") from None


class LlamaPeer:
    """Runs the llama.cpp rows for one pair."""

    def __init__(
        self,
        binaries,
        target_gguf: Path,
        draft_gguf: Path,
        spec: tuple[int, float],
        threads: int,
        pair,
        lookup: tuple[int, int] = (3, 3),
    ):
        self.binaries, self.target, self.draft = binaries, target_gguf, draft_gguf
        self.settings = {
            "llama_cpp": AUTOREGRESSIVE,
            "llama_cpp_spec": LlamaSetting(*spec),
            "llama_cpp_lookup": LlamaSetting(ngram=lookup),
        }
        self.threads, self.pair = threads, pair

    @classmethod
    def find(cls, config, pair, threads: int) -> tuple[LlamaPeer | None, str | None]:
        """The peer for ``pair`` (None and the reason when the programs or GGUF files are missing)."""
        if config.pair not in DEFAULT_PAIRS:
            return (
                None,
                f"llama.cpp rows need a pair published as GGUF ({', '.join(DEFAULT_PAIRS)}), not {config.pair}",
            )
        bin_dir = Path(config.llama_bin).expanduser() if config.llama_bin else default_bin_dir()
        binaries = find_binaries(bin_dir)
        if binaries is None:
            return None, (
                f"llama.cpp rows left out: no llama.cpp programs in {bin_dir} (build them once with "
                f"`python benchmarks/llama_cpp.py`, or pass --llama-bin)"
            )
        stale = None if config.llama_bin else stale_build(bin_dir)
        if stale:
            return None, (
                f"llama.cpp rows left out: the programs in {bin_dir} were {stale}; build them again with "
                "`python benchmarks/llama_cpp.py`"
            )
        target, draft = DEFAULT_PAIRS[config.pair]
        root = Path(config.cache_dir) if getattr(config, "cache_dir", None) else cache_dir()
        paths = fetch_gguf(target, root, progress=False), fetch_gguf(draft, root, progress=False)
        lookup = parse_lookup_setting(config.llama_lookup)
        peer = cls(binaries, paths[0], paths[1], parse_spec_setting(config.llama_spec), threads, pair, lookup)
        return peer, None

    def describe(self, name: str) -> str:
        setting = self.settings[name]
        if setting.ngram is not None:
            what = (
                f"n-gram lookup, --spec-type ngram-simple --spec-ngram-simple-size-n {setting.ngram[0]} "
                f"--spec-ngram-simple-size-m {setting.ngram[1]}"
            )
        elif setting.n_max is None:
            what = "autoregressive"
        else:
            what = f"speculative, --spec-draft-n-max {setting.n_max} --spec-draft-p-min {setting.p_min:g}"
        version = (self.binaries.version or {}).get("version", "?")
        return f"llama.cpp {version} ({what}), {self.threads} threads, same GGUF files"

    def run(self, name: str, prompt: str, max_new_tokens: int, seed: int) -> dict:
        """One greedy request; a measurement like ``evaluation.measurements.run_engine``'s."""
        text = self.pair.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        setting = self.settings[name]
        out = run_llama_cpp(
            self.binaries,
            setting,
            text,
            self.target,
            None if setting.n_max is None else self.draft,
            max_new_tokens=max_new_tokens,
            threads=self.threads,
            seed=seed,
        )
        tokens = self.pair.encode(out.get("output", ""), chat=False)
        n = int(out["tokens"])
        prompt_s = float(out.get("prompt_s") or 0.0)
        decode_s = float(out["decode_s"])
        return {
            "tokens": tokens,
            "num_tokens": n,
            "total_s": prompt_s + decode_s,
            "ttft_s": prompt_s,
            "decode_s": decode_s,
            "finish_reason": "length" if n >= max_new_tokens else "eos",
            "peak_memory_mb": float("nan"),
            "cycles": [],
            "first_chunk": 1,
            "llama": {k: out.get(k) for k in ("tok_s", "accept", "n_drafted", "n_accept", "wall_s")},
        }
