// bench/versus_graphile.py's drain task: waits BENCH_CALL_MS milliseconds (0: none) and succeeds; with
// BENCH_CALL_URL it POSTs the job's payload there instead (Node's fetch, keep-alive) and fails unless it is 2xx. The process
// tells the benchmark when its first job started and when its BENCH_COUNT-th ended (two UDP datagrams
// "first|last <seconds>", the machine clock): a datagram for every job could be dropped in a burst.
const dgram = require("node:dgram");

const socket = dgram.createSocket("udp4");
const port = Number(process.env.BENCH_PORT);
const count = Number(process.env.BENCH_COUNT);
const callMs = Number(process.env.BENCH_CALL_MS || "0");
const callUrl = process.env.BENCH_CALL_URL || "";
let started = 0;
let done = 0;

const now = () => ((performance.timeOrigin + performance.now()) / 1000).toFixed(6);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

module.exports = async (payload) => {
  if (started++ === 0) socket.send(`first ${now()}`, port, "127.0.0.1");
  if (callUrl) {
    const response = await fetch(callUrl, {
      method: "POST", body: JSON.stringify(payload), headers: { "content-type": "application/json" },
    });
    await response.arrayBuffer();
    if (!response.ok) throw new Error(`POST ${callUrl} answered ${response.status}`);
  } else if (callMs > 0) await sleep(callMs);
  if (++done === count) socket.send(`last ${now()}`, port, "127.0.0.1");
};
