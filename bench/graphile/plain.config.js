// graphile-worker at its defaults, for bench/versus_graphile.py (the concurrency is given on its command line).
module.exports = { worker: {} };
