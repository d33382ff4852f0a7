"""``raygym data prepare SOURCE --out DIR [...]``: the CLI face of :mod:`raygym.data.prepare`.

    raygym data prepare hf:openai/gsm8k --hf-config main --out data/gsm8k \\
        --input-key question --label-key answer --eval-size 500
    raygym data prepare rows.csv --out data/rows --prompt-template "{q}\\nanswer:" --eval-size 0.1
    raygym data prepare reasoning-gym:letter_counting --size 2048 --seed 0 --out data/letters --eval-size 64
"""

from __future__ import annotations

import click

from raygym.data.prepare import PrepareOptions, prepare_dataset


@click.group()
def data() -> None:
    """Prepare prompt datasets for training."""


@data.command()
@click.argument("source")
@click.option("--out", "out_dir", required=True, help="Directory for train.jsonl, eval.jsonl and stats.json.")
@click.option("--input-key", default="prompt", show_default=True, help="Column holding the prompt.")
@click.option("--label-key", default="label", show_default=True, help="Column holding the label ('' for none).")
@click.option("--metadata-keys", default="", help="Comma-separated columns copied into each row's metadata.")
@click.option("--prompt-template", default=None, help="Prompt as a format string over columns: '{question}\\nanswer:'.")
@click.option("--label-regex", default=None, help="Keep the first (group) of this match in the label.")
@click.option("--system-prompt", default=None, help="A system turn (chat) or a first line (plain text).")
@click.option("--as-messages", is_flag=True, help="Write prompts as chat messages (train with --apply-chat-template).")
@click.option("--chat-template", default=None, help="Tokenizer whose chat template renders the prompts now.")
@click.option("--tokenizer", default=None, help="Tokenizer for token statistics and --max-prompt-tokens.")
@click.option("--max-prompt-tokens", type=int, default=None, help="Drop prompts longer than this (tokens).")
@click.option("--max-prompt-chars", type=int, default=None, help="Drop prompts longer than this (characters).")
@click.option("--eval-size", type=float, default=0.0, show_default=True,
              help="Held-out rows: a fraction in (0, 1) or a count.")
@click.option("--max-rows", type=int, default=None, help="Keep at most this many rows.")
@click.option("--seed", type=int, default=0, show_default=True, help="Shuffle and split seed.")
@click.option("--no-shuffle", is_flag=True, help="Keep the source order (the eval split is then the first rows).")
@click.option("--format", "file_format", default="auto", show_default=True,
              type=click.Choice(["auto", "jsonl", "json", "csv", "parquet"]), help="Source file format.")
@click.option("--hf-config", default=None, help="hf: sources: the dataset configuration (e.g. 'main').")
@click.option("--split", default="train", show_default=True, help="hf: and save_to_disk sources: the split.")
@click.option("--size", type=int, default=None,
              help="reasoning-gym:<task> sources: how many items to generate (with --seed).")
def prepare(source: str, out_dir: str, input_key: str, label_key: str, metadata_keys: str,
            prompt_template: str | None, label_regex: str | None, system_prompt: str | None, as_messages: bool,
            chat_template: str | None, tokenizer: str | None, max_prompt_tokens: int | None,
            max_prompt_chars: int | None, eval_size: float, max_rows: int | None, seed: int, no_shuffle: bool,
            file_format: str, hf_config: str | None, split: str, size: int | None) -> None:
    """Turn SOURCE (jsonl/json/csv/parquet file or URL, a save_to_disk directory, hf:NAME, or
    reasoning-gym:TASK[?config] generated offline) into
    raygym's prompt files {"prompt", "label", "metadata"}."""
    options = PrepareOptions(
        source=source, out_dir=out_dir, input_key=input_key, label_key=label_key or None,
        metadata_keys=[k.strip() for k in metadata_keys.split(",") if k.strip()],
        prompt_template=_unescape(prompt_template), label_regex=label_regex, system_prompt=_unescape(system_prompt),
        as_messages=as_messages, chat_template=chat_template, tokenizer=tokenizer,
        max_prompt_tokens=max_prompt_tokens, max_prompt_chars=max_prompt_chars, eval_size=eval_size,
        max_rows=max_rows, seed=seed, shuffle=not no_shuffle, file_format=file_format, hf_config=hf_config,
        split=split, size=size,
    )
    report = prepare_dataset(options)
    for line in report.summary_lines():
        click.echo(line)
    click.echo(f"stats:  {out_dir.rstrip('/')}/stats.json")


def _unescape(text: str | None) -> str | None:
    """Shell users write a newline as the two characters backslash-n."""
    return None if text is None else text.replace("\\n", "\n").replace("\\t", "\t")
