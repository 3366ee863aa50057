"""Draft heads: one interface (``base.DraftHead``), one drafting contract (``drafting``), one file per family.

Loading an exported head (ours or a serving format) is :func:`models.formats.load_draft`."""
from models.heads.base import DraftHead, HeadOutput
from models.heads.drafting import Drafter, Proposal, Sampler, draw

__all__ = ["DraftHead", "Drafter", "HeadOutput", "Proposal", "Sampler", "draw"]
