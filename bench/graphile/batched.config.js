// graphile-worker's batching, for bench/versus_graphile.py's "batched" runs: a local queue that locks and pulls
// down jobs a page at a time (the size of correlation-worker's default page), and completions written in batches.
module.exports = {
  worker: {
    localQueue: { size: 100 },
    completeJobBatchDelay: 0,
    failJobBatchDelay: 0,
  },
};
