"""Where the datasets come from and what their records mean: sources, meeting links, words."""
