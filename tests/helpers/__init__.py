"""What tests share besides fixtures: repository paths, the tiny test model, server fakes."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO / "recipes" / "demo-model"
