"""Planning: the params file's experiments checked and resolved into plan files (the plan stage, presets, report)."""
