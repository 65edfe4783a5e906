"""The `runtime` command. Today: `runtime generate` (greedy or sampled text from an artifact).

The continuous-batching server (`runtime serve`) and benchmark (`runtime bench`) are added by
the runtime issue; until then only the commands below exist.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run slimserve artifacts and Hugging Face checkpoints.")
console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """Run slimserve artifacts and Hugging Face checkpoints."""


@app.command()
def generate(
    model: str = typer.Argument(..., help="slimserve artifact, local HF checkpoint or HF model id"),
    prompt: str = typer.Option(..., "--prompt", "-p", help="text to continue"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, max=4096),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy"),
    seed: int = typer.Option(0, help="sampling seed"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
) -> None:
    """Continue a prompt with the model (dequantizing quantized weights on the fly)."""
    import torch

    from slimserve.runtime.errors import ArtifactError
    from slimserve.runtime.loader import load_model

    try:
        loaded = load_model(model, dtype=torch.float32, trust_remote_code=trust_remote_code)
    except (ArtifactError, FileNotFoundError) as e:
        console.print(f"[bold red]error:[/] {str(e).splitlines()[0]}", highlight=False)
        raise typer.Exit(2)
    tok = loaded.tokenizer
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.numel() == 0:
        console.print("[bold red]error:[/] --prompt is empty; give some text to continue")
        raise typer.Exit(2)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = loaded.model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
            pad_token_id=tok.eos_token_id,
        )
    sys.stdout.write(prompt + tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True) + "\n")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
