"""Look inside: Toeplitzness, positional score profiles, TISA fitting, attention rank and
learned-structure plots (TISA §3 and App. B-C, DIET Thm 1, Chang Fig 2-3). See :mod:`.cli`."""
