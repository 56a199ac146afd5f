// bench/versus_graphile.py's latency task: tells the benchmark each job's id and start time (one UDP datagram
// "<id> <seconds>" on the loopback, the machine clock), as bench/latency_correlator.py does for correlation-worker.
const dgram = require("node:dgram");

const socket = dgram.createSocket("udp4");
const port = Number(process.env.BENCH_PORT);

module.exports = async (_payload, helpers) => {
  const now = (performance.timeOrigin + performance.now()) / 1000;
  socket.send(`${helpers.job.id} ${now.toFixed(6)}`, port, "127.0.0.1");
};
