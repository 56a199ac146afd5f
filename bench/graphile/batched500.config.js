// graphile-worker's batching with a local queue of 500 jobs (five times correlation-worker's default page), for
// bench/versus_graphile.py's "batched 500" runs: its fastest drain of a backlog here.
module.exports = {
  worker: {
    localQueue: { size: 500 },
    completeJobBatchDelay: 0,
    failJobBatchDelay: 0,
  },
};
