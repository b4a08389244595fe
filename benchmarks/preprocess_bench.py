"""Benchmark ``data.preprocess`` against Megatron-LM's two reference preprocessors.

Builds a JSONL corpus of real text from Debian documentation packages (nothing downloaded), then runs, one
after another on the same file and the same tokenizer.json:

* ours:     ``python -m data.preprocess``                      (this repository)
* classic:  ``tools/preprocess_data.py``   (multiprocessing pool, one HF tokenizer per worker)
* fast:     ``tools/preprocess_data_fast.py`` (gigatoken ``encode_files``: whole file in memory)

and prints wall time, tokens/s, peak memory and the ratios, and checks that the three outputs are byte-identical.

How the figures are made: the tools run interleaved (ours, classic, fast, ours, ...) ``--repeat`` times, so a
noisy neighbour slows every tool alike; tokens/s and every ratio use each tool's *median* wall (and CPU) time,
never its single fastest run. Peak memory is the peak, over the run, of the PSS (proportional set size) summed
over the process tree, sampled every 50 ms: a page shared by the classic tool's forked workers is counted once
in total, not once per process as summed RSS would (which inflates a forking tool several-fold). Summed RSS
is printed beside it for comparison. PSS needs /proc/PID/smaps_rollup of the tool's processes (same user).

The references are run from a Megatron-LM checkout outside this repository (``--megatron-lm``) with a Python
that has their extra needs (transformers, gigatoken, torch); nothing of theirs is copied here. Example:

    apt-get install python3.11-doc perl-doc linux-doc-6.1 dict-gcide
    python benchmarks/preprocess_bench.py --size-mb 100 --megatron-lm /tmp/megatron-lm --ref-python /tmp/refvenv/bin/python

``--size-mb 1000`` builds a 1 GB corpus (the ~100 MB of distinct text repeated) to show that our peak RSS is flat.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # launcher/core/indexed_files.py reads the .idx headers
SOURCES = [
    # (glob root, pattern, licence) — all installed by Debian packages
    ("/usr/share/doc/python3.11/html/_sources", "**/*.rst.txt", "PSF-2.0 (python3.11-doc)"),
    ("/usr/share/perl/5.36/pod", "*.pod", "Artistic/GPL (perl-doc)"),
    ("/usr/share/doc/linux-doc-6.1/Documentation", "**/*.gz", "GPL-2.0 (linux-doc-6.1)"),
    ("/usr/share/dictd", "gcide.dict.dz", "GPL-3+ (dict-gcide)"),
]
MAX_DOC_CHARS = 200_000
"""Split very large files (the dictionary) into documents of about this size, at blank lines."""


def _read(path: Path) -> str:
    raw = gzip.open(path).read() if path.suffix in (".gz", ".dz") else path.read_bytes()
    return raw.decode("utf-8", errors="replace")


def _split(text: str):
    while len(text) > MAX_DOC_CHARS:
        cut = text.rfind("\n\n", 0, MAX_DOC_CHARS)
        cut = cut if cut > 0 else MAX_DOC_CHARS
        yield text[:cut]
        text = text[cut:].lstrip("\n")
    if text.strip():
        yield text


def iter_documents():
    for root, pattern, _ in SOURCES:
        for path in sorted(Path(root).glob(pattern)):
            if path.is_file():
                yield from _split(_read(path))


def build_corpus(path: Path, size_mb: int) -> dict:
    """Write a JSONL corpus of about size_mb MB; when the sources run out, they are repeated (passes)."""
    target, written, docs, passes = size_mb * 1_000_000, 0, 0, 0
    tmp = path.with_suffix(".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        while written < target:
            passes += 1
            before = written
            for doc in iter_documents():
                line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
                f.write(line)
                written += len(line.encode("utf-8"))
                docs += 1
                if written >= target:
                    break
            if written == before:
                raise SystemExit("no source text found: apt-get install python3.11-doc perl-doc linux-doc-6.1 dict-gcide")
    os.replace(tmp, path)
    return {"path": str(path), "bytes": written, "documents": docs, "passes": passes}


def _pss_bytes(pid: int) -> int:
    """PSS of one process from /proc/PID/smaps_rollup (kB), the kernel's own proportional count; 0 for a
    process that is exiting (no mappings left). PermissionError when it belongs to another user."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


class _MemSampler(threading.Thread):
    """Peaks of the summed PSS and of the summed RSS of a process and all its descendants."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        import psutil

        self.proc, self.done = psutil.Process(pid), threading.Event()
        self.peak_pss = self.peak_rss = 0
        self.pss_ok = True

    def run(self):
        import psutil

        while not self.done.is_set():
            try:
                procs = [self.proc] + self.proc.children(recursive=True)
            except psutil.Error:
                procs = []
            pss = rss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                    pss += _pss_bytes(p.pid)
                except psutil.Error:
                    pass
                except PermissionError:
                    self.pss_ok = False
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
            self.done.wait(0.05)


def run_tool(name: str, cmd: list[str], env: dict, log: Path) -> dict:
    import resource

    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env)
        sampler = _MemSampler(proc.pid)
        sampler.start()
        rc = proc.wait()
        sampler.done.set()
        sampler.join()
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    if rc != 0:
        sys.stderr.write(log.read_text()[-3000:])
        raise SystemExit(f"{name} failed with exit code {rc}: {' '.join(cmd)}")
    return {"name": name, "wall_s": wall, "cpu_s": cpu, "peak_pss_mb": sampler.peak_pss / 2**20 if sampler.pss_ok
            else None, "peak_rss_mb": sampler.peak_rss / 2**20}


def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _tokens(prefix: str) -> int:
    """Token count from the .bin size and the token dtype named in the .idx header."""
    from launcher.core.indexed_files import read_index_header

    return os.path.getsize(prefix + ".bin") // read_index_header(prefix + ".idx").dtype.itemsize


def _command(name, args, corpus, env, ref_env, ref_tok):
    out = str(args.out / name)
    if name == "ours":
        return [sys.executable, "-m", "data.preprocess", "--input", str(corpus), "--tokenizer", str(args.tokenizer),
                "--output-prefix", out + "_text_document", "--workers", str(args.workers), "--append-eod"], \
            dict(env, PYTHONPATH=str(ROOT))
    if name == "classic":
        return [args.ref_python, str(args.megatron_lm / "tools/preprocess_data.py"), "--input", str(corpus),
                "--output-prefix", out, "--workers", str(args.workers), "--log-interval", "100000", *ref_tok], ref_env
    return [args.ref_python, str(args.megatron_lm / "tools/preprocess_data_fast.py"), "--input", str(corpus),
            "--output-prefix", out, "--use-gigatoken", *ref_tok], ref_env


def _median(xs):
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _mb(x) -> str:
    return "n/a" if x is None else f"{x:8.1f} MB"


def summarise(name: str, runs: list, corpus_bytes: int = 0) -> dict:
    """One tool's figures: medians of wall and CPU time (tokens/s and input MB/s from them), the largest peak
    PSS/RSS."""
    wall, cpu, tokens = _median([r["wall_s"] for r in runs]), _median([r["cpu_s"] for r in runs]), runs[-1]["tokens"]
    pss = [r["peak_pss_mb"] for r in runs]
    return {"name": name, "tokens": tokens, "runs": len(runs), "walls_s": [r["wall_s"] for r in runs],
            "median_wall_s": wall, "median_cpu_s": cpu, "tok_per_s": tokens / wall, "tok_per_cpu_s": tokens / cpu,
            "input_mb_per_s": corpus_bytes / 1e6 / wall,
            "peak_pss_mb": None if None in pss else max(pss), "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}


def ratio_line(ours: dict, ref: dict) -> str:
    mem = (f"{ours['peak_pss_mb'] / ref['peak_pss_mb']:.2f}x peak PSS" if ours["peak_pss_mb"] and ref["peak_pss_mb"]
           else f"{ours['peak_rss_mb'] / ref['peak_rss_mb']:.2f}x peak summed RSS (PSS unavailable)")
    return (f"ours / {ref['name']} (medians): {ours['tok_per_s'] / ref['tok_per_s']:.2f}x tokens/s wall, "
            f"{ours['tok_per_cpu_s'] / ref['tok_per_cpu_s']:.2f}x tokens/cpu-s, {mem}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="preprocess benchmark: ours vs Megatron-LM classic and fast")
    ap.add_argument("--size-mb", type=int, default=100)
    ap.add_argument("--corpus", type=Path, default=None, help="reuse/build this JSONL (default /tmp/pp_bench_<size>MB.jsonl)")
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "data/assets/tokenizer.json")
    ap.add_argument("--megatron-lm", type=Path, default=Path("/tmp/megatron-lm"), help="Megatron-LM checkout")
    ap.add_argument("--ref-python", default=sys.executable, help="python with transformers+gigatoken+torch")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--only", nargs="+", default=["ours", "classic", "fast"], choices=["ours", "classic", "fast"])
    ap.add_argument("--repeat", type=int, default=3, help="runs per tool, interleaved; medians are reported")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "pp_bench_out")
    args = ap.parse_args(argv)

    corpus = args.corpus or Path(tempfile.gettempdir()) / f"pp_bench_{args.size_mb}MB.jsonl"
    if not corpus.exists():
        print("building corpus:", json.dumps(build_corpus(corpus, args.size_mb)), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    # The references load the tokenizer through transformers' AutoTokenizer, which wants a directory.
    tokdir = args.out / "tokenizer"
    tokdir.mkdir(exist_ok=True)
    (tokdir / "tokenizer.json").write_bytes(args.tokenizer.read_bytes())
    (tokdir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="true")
    ref_env = dict(env, PYTHONPATH=str(args.megatron_lm))
    ref_tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokdir), "--append-eod"]
    results, prefixes, runs = [], {}, {name: [] for name in args.only}
    for rep in range(args.repeat):
        for name in args.only:  # interleaved, so a noisy neighbour hurts every tool alike
            cmd, run_env = _command(name, args, corpus, env, ref_env, ref_tok)
            res = run_tool(name, cmd, run_env, args.out / f"{name}.log")
            prefixes[name] = str(args.out / name) + "_text_document"
            res["tokens"] = _tokens(prefixes[name])
            runs[name].append(res)
            print(f"  run {rep + 1} {name:8s} {res['wall_s']:7.2f} s wall {res['cpu_s']:7.2f} s cpu "
                  f"PSS {_mb(res['peak_pss_mb'])} RSS {res['peak_rss_mb']:8.1f} MB", flush=True)
    print(f"corpus {corpus} ({corpus.stat().st_size / 1e6:.0f} MB); medians of {args.repeat} interleaved runs; "
          f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {_cpu_model()}"
          f", {time.strftime('%Y-%m-%d', time.gmtime())}")
    for name in args.only:
        results.append(summarise(name, runs[name], corpus.stat().st_size))
        res = results[-1]
        print(f"{name:8s} {res['tokens']:>13,d} tokens  median {res['median_wall_s']:7.2f} s "
              f"(runs {', '.join(f'{w:.2f}' for w in res['walls_s'])})  {res['input_mb_per_s']:6.1f} MB/s  "
              f"{res['tok_per_s'] / 1e6:6.2f} M tok/s wall  "
              f"{res['tok_per_cpu_s'] / 1e6:6.2f} M tok/cpu-s  peak PSS {_mb(res['peak_pss_mb'])}  "
              f"(summed RSS {res['peak_rss_mb']:.1f} MB)", flush=True)

    by = {r["name"]: r for r in results}
    if "ours" in by:
        for ref in ("classic", "fast"):
            if ref in by:
                print(ratio_line(by["ours"], by[ref]))
    digests = {n: (_sha(p + ".bin"), _sha(p + ".idx")) for n, p in prefixes.items()}
    same = len(set(digests.values())) == 1
    print("outputs byte-identical:" if same else "OUTPUTS DIFFER:", {n: d[0][:12] + "/" + d[1][:12] for n, d in digests.items()})
    print(json.dumps({"corpus": str(corpus), "corpus_bytes": corpus.stat().st_size, "results": results,
                      "identical": same}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
