"""A round's life: what a push must pass and weighs (admission), how its bytes join the round's
sum (ingest), the round itself and its mean (round), when it closes and the close (policy),
and the outer step along its mean (outer)."""
