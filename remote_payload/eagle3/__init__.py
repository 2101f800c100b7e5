"""EAGLE-3 draft heads: config, model, loader, the offline walk (docs/eagle3.md)."""
