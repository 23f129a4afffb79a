"""What every part of fedhier uses: one-line errors for users, and seeded randomness as a
pure function of (seed, purpose, ids) (why engines can be compared number for number)."""
