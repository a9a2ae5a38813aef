"""The families table of docs/models.md: every transformers causal LM whose config declares a
pipeline plan (and the rows raypipe adds for what a plan cannot say), with the verdict of
`verify` on a small model of its default config: exact, or refused and why.

    python -m raypipe.models.hf.table        # writes the table between its markers (about a minute)

The suite checks that the table names the installed transformers and every type it declares.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

BEGIN, END = "<!-- families: begin -->", "<!-- families: end -->"
DOCS = Path(__file__).resolve().parents[3] / "docs" / "models.md"


def model_types() -> list[str]:
    """Every causal-LM model type transformers declares a pipeline plan for, and `skeleton.ROWS`'."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from raypipe.models.hf.skeleton import ROWS

    found = set(ROWS)
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config_class = CONFIG_MAPPING[model_type]
        except (KeyError, ValueError):
            continue
        if getattr(config_class, "base_model_pp_plan", None):
            found.add(model_type)
    return sorted(found)


def verdict_of(model_type: str) -> tuple[str, str]:
    """("exact" | "refused", why) for a small model of `model_type`'s default config."""
    from transformers import AutoConfig

    from raypipe.core.errors import ConfigError
    from raypipe.models.hf import skeleton, verify

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.for_model(model_type)
            skeleton.plan_of(config)
            found = verify.verdict(config)
    except ConfigError as error:
        return "refused", str(error).split(": ", 1)[-1].split(". It is refused")[0]
    except Exception as error:  # noqa: BLE001 - a default config that does not even build
        return "refused", f"its default config cannot be checked ({type(error).__name__})"
    return "exact", "routing loss carried through the pipeline" if found["aux_loss"] else ""


def render(rows: list[tuple[str, str, str]], version: str) -> str:
    exact = sum(1 for _, v, _ in rows if v == "exact")
    lines = [
        BEGIN,
        f"transformers {version}: {exact} of {len(rows)} causal LMs with a pipeline plan train exactly, each "
        f"checked on a small model of its default config (`python -m raypipe.models.hf.table` makes this "
        f"table). Your config gets a verdict of its own when `hf.from_pretrained` reads it.",
        "",
        "| model type | raypipe | note |",
        "|---|---|---|",
        *(f"| `{t}` | {v} | {_cell(why)} |" for t, v, why in rows),
        END,
    ]
    return "\n".join(lines)


def _cell(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return (line[:157] + "...") if len(line) > 160 else line.replace("|", "/")


def written_table(text: str) -> tuple[str | None, list[str]]:
    """The transformers version and model types the docs' table names."""
    block = text[text.index(BEGIN) : text.index(END)] if BEGIN in text and END in text else ""
    version = re.search(r"transformers (\S+):", block)
    return (version.group(1) if version else None), re.findall(r"^\| `([^`]+)` \|", block, flags=re.M)


def main(argv: object = None) -> None:
    import transformers

    rows = [(t, *verdict_of(t)) for t in model_types()]
    text = DOCS.read_text()
    table = render(rows, transformers.__version__)
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + table + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip() + "\n\n" + table + "\n"
    DOCS.write_text(text)
    print(f"{sum(1 for r in rows if r[1] == 'exact')} of {len(rows)} exact; written to {DOCS}")


if __name__ == "__main__":
    main()
