"""Knowledge editing of STEM models: swap the table rows an entity's tokens look up for another entity's.

- `spans`: entity -> token span in a prompt, and the length-mismatch strategies (`align`, `STRATEGIES`).
- `positional`: per-call edits at a prompt's span through the model's `rows` / `embed_rows` hooks
  (`make_edit`, `edited_forward`, `positional_edit` context manager, `generate_edited` with the KV cache).
- `table_edits`: global edits and injection written into the tables with exact undo (`TableEditor`).
- `evaluate`: edit metrics on CounterFact-style records beside unedited values and chance (`evaluate_edits`);
  `report`: their text table with a legend (`format_edit_table`).

    from stemlm.edit import make_edit, positional_edit
    edit = make_edit(model, tokenizer, prompt_ids, "Spain", "Germany")
    with positional_edit(model, edit) as edited:
        print(edited.generate(prompt_ids, max_new_tokens=5))
"""

from stemlm.edit.positional import (
    EditedModel,
    PositionalEdit,
    batch_hooks,
    edited_forward,
    generate_edited,
    greedy_generate,
    make_edit,
    positional_edit,
)
from stemlm.edit.spans import (
    DEFAULT_PAD,
    GLOBAL_DEFAULT_PAD,
    PAD_ROWS,
    STRATEGIES,
    Span,
    align,
    entity_ids,
    locate,
)
from stemlm.edit.table_edits import TableEditor, UndoRecord, apply_global_edit, global_edit_hooks, undo

__all__ = [
    "DEFAULT_PAD",
    "GLOBAL_DEFAULT_PAD",
    "PAD_ROWS",
    "STRATEGIES",
    "EditedModel",
    "PositionalEdit",
    "Span",
    "TableEditor",
    "UndoRecord",
    "align",
    "apply_global_edit",
    "batch_hooks",
    "edited_forward",
    "entity_ids",
    "generate_edited",
    "global_edit_hooks",
    "greedy_generate",
    "locate",
    "make_edit",
    "positional_edit",
    "undo",
]
