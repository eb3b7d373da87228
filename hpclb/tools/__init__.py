"""Programs built on training: evaluate, sweep, scale, advise, plot, and job scripts."""
