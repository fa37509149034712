"""Developer tools run by hand (not part of the pipeline, the wheel or the Flower app bundle)."""
