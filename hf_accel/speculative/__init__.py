"""Speculative generation: strategies, verification rules, the decoding loop and its generate keywords."""

from .draft import DraftModel
from .self_draft import SelfSpeculative
from .strategies import AdaptiveK, Composite, PromptLookup, Proposal, Strategy
from .verify import Verdict, verify_greedy, verify_sampling

__all__ = [
    "AdaptiveK",
    "Composite",
    "DraftModel",
    "PromptLookup",
    "Proposal",
    "SelfSpeculative",
    "Strategy",
    "Verdict",
    "verify_greedy",
    "verify_sampling",
]
