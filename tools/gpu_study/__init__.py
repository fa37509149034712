"""The converged GPU study in one call of a lent GPU machine: prepare (here), device (there), import (here)."""
