"""Real text: offline sources, tokenizers, tokenised corpora (memory-mapped token ids)."""
