"""Draft heads: one interface (`base.DraftHead`), one file per family."""
from models.heads.base import DraftHead, HeadOutput, load_draft

__all__ = ["DraftHead", "HeadOutput", "load_draft"]
