"""`python -m export`: build artifacts (the ONNX variants, each checked against the PyTorch original).

python -m export build --preset seed --out build/artifacts/seed
python -m export build --config my_config.json --out artifacts/mine
python -m export build --weights mha.pt --layout torch-mha --n-heads 8 --out artifacts/trained
python -m export build --weights hf_checkpoint/ --layout hf --out artifacts/llama
python -m export build --weights hf_checkpoint/ --layout hf --attention-only --out artifacts/llama-attention
python -m export build --preset seed --out artifacts/seed --variants cuda,fp32-static-int8kv
python -m export build --preset seed --out artifacts/seed --calibration hidden.npy
python -m export inspect build/artifacts/seed --tokens 24 --seed 0 --out maps.png
python -m export inspect artifacts/llama --text "The cat sat on the mat." --out maps.png
python -m export inspect artifacts/llama --repeat 32 --out maps.png

A build makes the variants this machine serves (the CPU's; a CUDA or TensorRT host's add theirs);
--variants names others, or a set of them: cpu, cuda, tensorrt, all. With --weights the weights are
a trained model's state dict (a file, or a checkpoint folder) in one of the layouts of
export/importers.py (seeds, torch-mha, hf, native); --config then gives only the fields the weights
do not determine (max_seq_len, norm_eps, residual). `--layout hf` imports the whole decoder (token ids
in, logits out; Llama, Mistral, Qwen2, Qwen3, Phi-3, GPT-2), `--attention-only` its attention blocks
alone. See docs/importing.md. With --calibration the
quantized KV caches' scales are calibrated on your hidden states (N, T, d_model) instead of generated ones.
`inspect` draws every head's attention weights, as the fused graph that serves computes them, and
prints what each head attends to (export/inspect_form.py, contract/heads.py); a whole model built with its
checkpoint's tokenizer takes --text, and its maps are labelled with the tokens.

A Triton model repository is filled from an artifact by `python -m serving repository` (or built and
filled in one go by `python -m serving ensure`).

Only the command that runs imports torch: --help and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
from pathlib import Path

from contract.arguments import DefaultsHelp, config_arguments, config_from
from contract.config import ModelConfig
from export.choices import FP32_FUSED, INSPECTED_VARIANTS, LAYOUT_NAMES, VARIANT_SETS, expand, parse_variants
from export.hf_config import checkpoint_instead


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="python -m export", description=__doc__.splitlines()[0], formatter_class=DefaultsHelp
    )
    commands = root.add_subparsers(dest="command", metavar="{build,inspect,train}")
    b = commands.add_parser(
        "build",
        formatter_class=DefaultsHelp,
        help="export the ONNX variants of a config and check them against PyTorch",
    )
    config_arguments(b)
    b.add_argument("--out", type=Path, required=True, help="the artifact directory to write")
    b.add_argument(
        "--variants",
        type=parse_variants,
        help=f"comma-separated variants or sets ({', '.join(VARIANT_SETS)}) (default: what this machine serves, "
        "that the config can have)",
    )
    b.add_argument("--seed", type=int, help="weight initialization seed for random weights (default 0)")
    b.add_argument(
        "--calibration",
        type=Path,
        help="a .npy of hidden states (N, T, d_model) to calibrate the quantized KV caches' scales on "
        "(default: generated ones, export/kv_quant.py)",
    )
    b.add_argument(
        "--int4-head-bits",
        type=int,
        choices=(8,),
        help="a whole model's head in 8 bits in the 4-bit weights' variants (onnxruntime-genai's last_matmul:int8: "
        "the logits' error is the head's, at twice its 4-bit bytes) (default: 4, as every projection)",
    )
    own = b.add_argument_group("a trained model's weights (docs/importing.md)")
    own.add_argument(
        "--weights",
        type=Path,
        help="its state dict: .safetensors, a torch.save'd state_dict, or a checkpoint folder (its "
        "model.safetensors, or a sharded checkpoint's index)",
    )
    own.add_argument("--layout", choices=sorted(LAYOUT_NAMES), help="how its keys are named (export/importers.py)")
    own.add_argument(
        "--attention-only",
        action="store_true",
        help="with --layout hf: import each layer's attention block alone (x + Attention(Norm(x)), hidden states "
        "in and out), the rest of the checkpoint left out and listed, instead of the whole decoder",
    )
    own.add_argument(
        "--held-out",
        type=Path,
        metavar="FILE",
        help="a held-out text (entries separated by lines of %%): every form's loss on it in bits per byte, in the "
        "report (export/quality.py) (default: the checkpoint folder's held_out.txt, when it has one)",
    )
    own.add_argument("--n-heads", type=int, help="attention heads (the weights cannot tell)")
    own.add_argument("--n-kv-heads", type=int, help="key/value heads, instead of --n-heads (GQA)")
    _inspect_parser(commands)
    _train_parser(commands)
    return root


def _train_parser(commands) -> None:
    from export.training import FORTUNES, TrainSettings

    defaults = TrainSettings()
    t = commands.add_parser(
        "train",
        formatter_class=DefaultsHelp,
        help="train a small decoder and its tokenizer on Debian's fortunes; write a Hugging Face checkpoint folder",
    )
    t.add_argument("--out", type=Path, required=True, metavar="FOLDER", help="the checkpoint folder to write")
    t.add_argument("--corpus", type=Path, default=FORTUNES, metavar="DIR", help="a folder of fortune files")
    helps = {
        "steps": "optimizer steps",
        "batch": "windows a step",
        "context": "ids a window; also the model's max_position_embeddings",
        "vocab_size": "the byte-level BPE's ids",
        "d_model": "the model's width",
        "n_layers": "decoder blocks",
        "mlp_width": "the gated MLP's inner width",
        "seed": "weights, windows and order: the same seed, the same model",
    }
    for field, text in helps.items():
        t.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field), help=text)


def train_and_report(args: argparse.Namespace) -> int:
    """`train`: the corpus read, the tokenizer and the model trained, the folder written, the report printed."""
    import dataclasses

    from export.progress import Progress
    from export.train import train, write_folder
    from export.training import Corpus, TrainingError, TrainSettings

    fields = {f.name for f in dataclasses.fields(TrainSettings)}
    try:
        settings = TrainSettings(**{k: v for k, v in vars(args).items() if k in fields})
        corpus = Corpus.read(args.corpus, settings.held_out_every)
        model, tokenizer, report = train(settings, corpus, Progress())
    except (TrainingError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    report["command"] = "python -m export train " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["train"] else [])
    try:
        write_folder(args.out, model, tokenizer, report, corpus.held_out)
    except OSError as error:
        print(cannot_write(args.out, error), file=sys.stderr)
        return 1
    held, baselines = report["held_out"], report["baselines"]
    print(
        f"held-out: {held['bits_per_byte']:.3f} bits/byte (perplexity {held['perplexity']:.1f}); bigram "
        f"{baselines['bigram']['bits_per_byte']:.3f}, unigram {baselines['unigram']['bits_per_byte']:.3f} bits/byte"
    )
    print(f"{report['tokens_seen']:,} tokens seen in {report['seconds']:.0f} s; checkpoint: {args.out}")
    return 0


def _inspect_parser(commands) -> None:
    i = commands.add_parser(
        "inspect",
        formatter_class=DefaultsHelp,
        help="draw each head's attention weights (from the fused graph) and print what each head attends to",
    )
    i.add_argument("artifact", type=Path, help="an artifact directory (python -m export build)")
    source = i.add_mutually_exclusive_group()
    source.add_argument(
        "--input",
        type=Path,
        metavar="FILE.npy",
        help="the hidden states to attend over: a .npy of (1, T, d_model) or (T, d_model), float",
    )
    source.add_argument(
        "--tokens",
        type=int,
        default=24,
        metavar="N",
        help="N random hidden states (standard normal) instead; a whole model's: N random token ids",
    )
    source.add_argument(
        "--repeat",
        type=int,
        metavar="N",
        help="a whole model's: N random token ids (not id 0) followed by the same N again; the table's induction "
        "column is the second copy's attention to the token after each token's first occurrence",
    )
    source.add_argument(
        "--text",
        metavar="TEXT",
        help="a whole model's: this text, encoded by the tokenizer its artifact carries (with the special tokens "
        "it adds, as transformers' tokenizer(text)); the maps' axes are labelled with its tokens",
    )
    i.add_argument("--seed", type=int, default=0, metavar="S", help="the random hidden states' (or ids') seed")
    i.add_argument("--variant", choices=INSPECTED_VARIANTS, default=FP32_FUSED, help="the graph whose maps are drawn")
    i.add_argument("--diff", action="store_true", help=f"draw the variant's maps minus {FP32_FUSED}'s instead")
    i.add_argument("--out", type=Path, required=True, metavar="FILE.png", help="the PNG to write")


def inspect_and_report(args: argparse.Namespace) -> int:
    """`inspect`: the maps of one call of an artifact's fused graph, drawn to a PNG, and the head table."""
    from contract.heads import statistics_table
    from export.inspect_form import InspectionError, artifact_config, draw_maps, inspect_artifact
    from export.progress import Progress

    progress = Progress()
    try:
        cfg = artifact_config(args.artifact)
        hidden, labels, origin = _inspected_input(args, cfg)
        inspection = inspect_artifact(args.artifact, hidden, args.variant, args.diff, progress)
    except (InspectionError, ValueError) as error:  # ValueError: a config.json that is not a config
        print(f"error: {error}", file=sys.stderr)
        return 2
    progress.note(f"graph: {inspection.source}")
    what = f"{inspection.variant} - fp32-fused" if args.diff else f"{inspection.variant} attention weights"
    title = f"{args.artifact.name}: {what}, {hidden.shape[1]} tokens ({origin})"
    try:
        with progress.stage(f"heatmaps -> {args.out}"):
            draw_maps(inspection, cfg, args.out, title, labels)
    except InspectionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"error: cannot write {args.out}: {error.strerror or error}", file=sys.stderr)
        return 1
    if cfg.whole:
        print("ids: " + " ".join(str(token) for token in hidden[0].tolist()))
    if labels is not None:  # a label holds no blank (inspect_form.token_label): one line, split on spaces
        print("tokens: " + " ".join(labels))
    print(statistics_table(inspection.statistics))
    if args.diff:
        largest, (layer, head, query, key) = inspection.largest_difference()
        print(f"largest |{what}|: {largest:.3e} (layer {layer}, head {head}, query {query}, key {key})")
    print(f"maps: {args.out}")
    return 0


def _inspected_input(args: argparse.Namespace, cfg: ModelConfig):
    """(the hidden states or a whole model's ids, the tokens' labels or None, where they came from)."""
    from export.inspect_form import hidden_states_from_file, random_hidden_states, repeated_random_ids, text_tokens

    if args.repeat is not None:
        ids = repeated_random_ids(cfg, args.repeat, args.seed)
        return ids, None, f"{args.repeat} random ids twice, seed {args.seed}"
    if args.text is not None:
        tokens = text_tokens(args.artifact, cfg, args.text)
        return tokens.ids, tokens.labels, "text"
    if args.input:
        return hidden_states_from_file(args.input, cfg), None, str(args.input)
    return random_hidden_states(cfg, args.tokens, args.seed), None, f"random, seed {args.seed}"


def _misuse(args: argparse.Namespace) -> str | None:
    """Flags that do not go together (argparse cannot say so)."""
    weights, layout = getattr(args, "weights", None), getattr(args, "layout", None)
    if layout and not weights:
        return "--layout goes with --weights"
    if getattr(args, "attention_only", False) and layout != "hf":
        return "--attention-only goes with --layout hf (a whole checkpoint's attention blocks)"
    if weights and not layout:
        return f"--weights needs --layout (one of {sorted(LAYOUT_NAMES)})"
    if weights and (args.preset or args.seed is not None):
        return "--preset and --seed make random weights; --weights brings its own"
    if not weights and (getattr(args, "n_heads", None) or getattr(args, "n_kv_heads", None)):
        return "--n-heads and --n-kv-heads go with --weights (a config gives n_heads)"
    return None


def given_fields(args: argparse.Namespace) -> dict:
    """What the caller says about a trained model: --config (any fields) and --n-heads/--n-kv-heads."""
    fields = {}
    if args.config:
        data = json.loads(args.config.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{args.config}: a config must be a JSON object, got {type(data).__name__}")
        fields.update(data)
    fields |= {name: getattr(args, name) for name in ("n_heads", "n_kv_heads") if getattr(args, name) is not None}
    return fields


def held_out_text(args: argparse.Namespace) -> Path | None:
    """--held-out, or the checkpoint folder's held_out.txt (what `python -m export train` writes beside it)."""
    from contract.files import HELD_OUT_FILENAME

    if args.held_out is not None:
        return args.held_out
    folder = args.weights if args.weights.is_dir() else args.weights.parent
    return folder / HELD_OUT_FILENAME if (folder / HELD_OUT_FILENAME).is_file() else None


def import_and_report(args: argparse.Namespace) -> int:
    """`build --weights`: import, prove against the source module, build; nothing is written when the
    weights do not fit or do not match their module."""
    from export.build import build_model
    from export.importers import SourceMismatchError, import_weights
    from export.kv_quant import CalibrationError
    from export.report import origin_summary, printing

    try:
        imported = import_weights(args.weights, args.layout, given_fields(args), attention_only=args.attention_only)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except SourceMismatchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    origin = imported.origin
    try:
        calibration = calibration_from(args, imported.model.cfg)
    except CalibrationError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if headless(args, imported.model.cfg):
        return 2
    report = _built(
        lambda: printing(
            lambda: build_model(
                imported.model,
                args.out,
                args.variants,
                origin=origin,
                calibration=calibration,
                text_files=imported.text_files,
                held_out=held_out_text(args),
                int4_head_bits=args.int4_head_bits,
            ),
            args.out,
        ),
        args.out,
    )
    if report is None:
        return 1
    print(origin_summary(report))
    return 0


def headless(args: argparse.Namespace, cfg: ModelConfig) -> bool:
    """Whether --int4-head-bits was given where it changes nothing (build.int4_head_problem; its error printed),
    before anything is built."""
    from export.build import HOST, int4_head_problem

    problem = int4_head_problem(cfg, expand(args.variants or (HOST,)), args.int4_head_bits)
    if problem:
        print(f"error: --int4-head-bits {args.int4_head_bits}: {problem}", file=sys.stderr)
    return problem is not None


def _built(run, out) -> dict | None:
    """The report of the build `run`; None when it failed, its error printed (a variant that failed, a
    folder that cannot be written)."""
    from export.build import BuildError

    try:
        return run()
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
    except OSError as error:
        print(cannot_write(out, error), file=sys.stderr)
    return None


def calibration_from(args: argparse.Namespace, cfg: ModelConfig):
    """The user's calibration file (kv_quant.CalibrationData), checked against the config
    (kv_quant.CalibrationError names what is wrong); None without one."""
    from export.kv_quant import from_file

    path = getattr(args, "calibration", None)
    return from_file(path, cfg) if path else None


def cannot_write(out: Path, error: OSError) -> str:
    """One line for a build the file system refused (nothing was left half-written: build.py): the
    directory asked for and the OS error, not the staging file it happened on."""
    code = f" ({errno.errorcode[error.errno]})" if error.errno in errno.errorcode else ""
    where = f": {error.filename}" if error.filename and Path(error.filename) in (out, *out.parents) else ""
    return f"error: cannot write {out}: {error.strerror or error}{code}{where}; nothing was changed there"


def main(argv: list[str] | None = None) -> int:
    root = parser()
    args, unknown = root.parse_known_args(argv)
    if args.command is None:  # building takes minutes: only when asked for
        root.print_usage(sys.stderr)
        print(f"{root.prog}: error: give a command: build, inspect or train (--help says more)", file=sys.stderr)
        return 2
    if unknown:  # argparse would answer with the top-level usage; the command's own is the one that helps
        _commands(root).choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    commands = {"inspect": inspect_and_report, "train": train_and_report}
    return commands.get(args.command, build_and_print)(args)


def _commands(root: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))


def _config(args: argparse.Namespace) -> ModelConfig:
    """The config --config or --preset names (ValueError: a Hugging Face checkpoint given as --config)."""
    checkpoint = args.config and checkpoint_instead(args.config, "a config of ours (contract/config.py)")
    if checkpoint:
        raise ValueError(checkpoint)
    return config_from(args)


def build_and_print(args: argparse.Namespace) -> int:
    """`build`: random weights from a config (`--weights`: a trained model's, `import_and_report`)."""
    misuse = _misuse(args)
    if misuse:
        print(f"error: {misuse}", file=sys.stderr)
        return 2
    if args.weights:
        return import_and_report(args)
    from export.report import build_and_report

    try:
        cfg = _config(args)
        calibration = calibration_from(args, cfg)
    except (OSError, ValueError) as error:  # kv_quant.CalibrationError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 2
    if headless(args, cfg):
        return 2
    report = _built(
        lambda: build_and_report(
            cfg,
            args.out,
            args.variants,
            seed=args.seed or 0,
            calibration=calibration,
            int4_head_bits=args.int4_head_bits,
        ),
        args.out,
    )
    return 1 if report is None else 0


if __name__ == "__main__":
    sys.exit(main())
