"""`stemlm generate CKPT "prompt"`: sample a continuation from a checkpoint, printing tokens as they come.

    stemlm generate runs/tiny "The capital of France is" --max-new-tokens 40 --top-p 0.9 --seed 1
    stemlm generate runs/tiny --ids 464,3139,286 --greedy --json
    stemlm generate runs/tiny "Once upon a time" --max-new-tokens 200 --compile   # decoding steps compiled
    echo "The capital of Spain is" | stemlm generate runs/tiny - --greedy --echo   # prompt from stdin

CKPT is a checkpoint folder or a run folder (its newest checkpoint). The prompt is tokenized with the
checkpoint's tokenizer; `--ids` passes raw ids instead. Only the completion goes to stdout (streamed), the
speed line to stderr; `--json` prints one object instead: prompt, completion, ids and tokens/s.
"""

from __future__ import annotations

import sys

from stemlm.cli.common import add_inference_flags, add_json_flag, print_json
from stemlm.errors import StemlmError

EOT_TOKEN = "<|endoftext|>"
# Sampling defaults: plain T = 1 sampling from a small model wanders into rare tokens within a few words;
# a cooler temperature with top-k / top-p cut-offs (the usual defaults of HF generate and llama.cpp) keeps
# samples readable while still varying with --seed. --greedy or --temperature 0 turns sampling off.
DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P = 0.8, 50, 0.95


def run(args) -> int:
    from stemlm.inference.generate import TimedTokens, encode_prompt, generation_request
    from stemlm.inference.load import InferenceOptions, load_inference
    from stemlm.inference.requests import IncrementalDecoder

    if args.prompt == "-":
        args.prompt = sys.stdin.read().removesuffix("\n")  # `echo text |` adds a line break that is not prompt
    eos_token = EOT_TOKEN
    if args.chat:  # the template is read and the prompt rendered before the model loads: a refusal costs nothing
        from stemlm.checkpoint.runs import resolve_checkpoint
        from stemlm.inference.chat import require_chat

        chat = require_chat(resolve_checkpoint(args.ckpt))
        if args.prompt is None:
            raise StemlmError("--chat needs a prompt text (the user message), not --ids")
        args.prompt, eos_token = chat.render(args.prompt), chat.eos_token or EOT_TOKEN
    # Every forward of the loaded model runs under the --dtype autocast (stemlm.inference.inference_model).
    loaded = load_inference(args.ckpt, InferenceOptions.from_args(args))
    model, tokenizer, offloaded, amp = loaded.model, loaded.tokenizer, loaded.offloaded, loaded.autocast_dtype
    prompt_ids = encode_prompt(tokenizer, model.config.vocab_size, args.prompt, args.ids)
    eos_id = None if args.ignore_eos or tokenizer is None else tokenizer.token_to_id(eos_token)
    request = generation_request(
        prompt_ids,
        args.max_new_tokens,
        greedy=args.greedy,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_id=eos_id,
    )
    tokens = loaded.engine().stream(request)
    decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
    out = sys.stdout
    if args.echo and not args.json:
        out.write(tokenizer.decode(prompt_ids) if tokenizer is not None else " ".join(map(str, prompt_ids)) + " ")
    timed = TimedTokens(tokens)
    for token in timed:
        if not args.json:
            out.write(decoder.push(token) if decoder else f"{token} ")
            out.flush()
    new_ids, seconds, rate = timed.ids, timed.seconds, timed.rate
    completion = tokenizer.decode(new_ids) if tokenizer is not None else None
    if args.json:
        print_json(
            {
                "prompt": tokenizer.decode(prompt_ids) if args.prompt is None and tokenizer else args.prompt,
                "completion": completion,
                "prompt_ids": prompt_ids,
                **timed.report(),
                "autocast_dtype": str(amp).removeprefix("torch."),
                **({"tables": offloaded.report()} if offloaded else {}),
            }
        )
    else:
        out.write((decoder.flush() if decoder else "") + "\n")
        out.flush()
        print(f"[{len(new_ids)} tokens in {seconds:.2f} s, {rate:.1f} tokens/s]", file=sys.stderr)
        if offloaded:
            print(offloaded.summary(), file=sys.stderr)
    if offloaded:
        offloaded.close()
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="sample a continuation of a prompt from a checkpoint",
        description="Sample a continuation of a prompt from a checkpoint or run folder, printing tokens as produced.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint folder, or run folder (uses its newest checkpoint)")
    p.add_argument("prompt", nargs="?", help="prompt text, encoded with the checkpoint's tokenizer; - reads stdin")
    p.add_argument("--echo", action="store_true", help="print the prompt before the completion (text output)")
    p.add_argument("--ids", help="comma-separated prompt token ids instead of a prompt text, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (no sampling)")
    p.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_TEMPERATURE,
        help=f"softmax temperature for sampling; 0 means greedy (default {DEFAULT_TEMPERATURE})",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=DEFAULT_TOP_K,
        help=f"sample among the k most likely tokens only; 0 = off (default {DEFAULT_TOP_K})",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=DEFAULT_TOP_P,
        help=f"nucleus sampling: the smallest set of tokens with total probability >= p; 1 = off "
        f"(default {DEFAULT_TOP_P})",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same sample")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt as a user turn with the checkpoint's chat template (instruct models, e.g. an imported "
        "GGUF) and stop at the template's end-of-turn token",
    )
    p.add_argument("--ignore-eos", action="store_true", help="keep going past <|endoftext|> until --max-new-tokens")
    add_inference_flags(p)
    p.add_argument(
        "--compile",
        action="store_true",
        help="run the decoding steps through torch.compile (resident tables only; the first tokens wait for the "
        "compile, tens of seconds on a CPU; the same greedy tokens)",
    )
    add_json_flag(p)
    p.set_defaults(func=run)
