"""Shared plumbing: params, records and errors, atomic writes, CLI errors, integrity, stage timing."""
