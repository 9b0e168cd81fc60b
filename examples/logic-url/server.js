// Leasehold logic as a web service (Node.js, standard library only): the choice for logic in
// another language or in another app. Leasehold POSTs one request per run:
//
//   POST /   {"scope": "account", "recordId": "42", "fencingToken": 7, "attempt": 1}
//            (the token also in the x-leasehold-fencing-token header)
//
// Answer 2xx only when the work is done: any other answer, or no answer within the run's time
// limit, is a failed run (retried, then given up to the poison queue with the status and the
// start of the body as the reason). If Leasehold cancels a run it closes the connection.
//
// The service checks the fencing token on its writes: it remembers, per record, the highest
// token it has written with and refuses (409) a write with a lower one — a holder whose lease
// was lost (and whose record someone else now runs) cannot overwrite newer work.
//
//   PORT=8080 node examples/logic-url/server.js
//   LEASEHOLD_LOGIC_URL=http://127.0.0.1:8080/ leasehold serve
//
// GET /records/<scope>/<recordId> shows what was written (for you and the example's test).

'use strict';
const http = require('node:http');

const port = Number(process.env.PORT ?? 8080);
const workMs = Number(process.env.WORK_MS ?? 200);
const maxBody = 64 * 1024;

/** record key → { token, attempt, runs } : stands in for the system your logic writes to. */
const written = new Map();

function answer(res, status, body) {
  res.writeHead(status, { 'content-type': 'application/json' });
  res.end(JSON.stringify(body));
}

async function work(run, signal) {
  // Your work goes here. It is cancelled (signal) when Leasehold closes the connection.
  await new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, workMs);
    signal.addEventListener('abort', () => { clearTimeout(timer); reject(new Error('cancelled')); });
  });
}

function write(run) {
  const key = `${run.scope}/${run.recordId}`;
  const current = written.get(key);
  if (current && run.fencingToken < current.token) {
    return { ok: false, why: `fencing token ${run.fencingToken} is older than ${current.token}, already written` };
  }
  written.set(key, { token: run.fencingToken, attempt: run.attempt, runs: (current?.runs ?? 0) + 1 });
  return { ok: true };
}

const server = http.createServer((req, res) => {
  if (req.method === 'GET' && req.url.startsWith('/records/')) {
    const key = decodeURIComponent(req.url.slice('/records/'.length));
    const state = written.get(key);
    return state ? answer(res, 200, state) : answer(res, 404, { error: `nothing written for ${key}` });
  }
  if (req.method !== 'POST' || req.url !== '/') {
    return answer(res, 404, { error: 'POST / with a run, or GET /records/<scope>/<recordId>' });
  }
  let size = 0;
  const chunks = [];
  req.on('data', (chunk) => {
    size += chunk.length;
    if (size > maxBody) { answer(res, 413, { error: `body over ${maxBody} bytes` }); req.destroy(); return; }
    chunks.push(chunk);
  });
  req.on('end', async () => {
    let run;
    try {
      run = JSON.parse(Buffer.concat(chunks).toString('utf8'));
    } catch (e) {
      return answer(res, 400, { error: `body is not JSON: ${e.message}` });
    }
    if (typeof run.scope !== 'string' || typeof run.recordId !== 'string' || !Number.isInteger(run.fencingToken)) {
      return answer(res, 400, { error: 'expected {scope, recordId, fencingToken, attempt}' });
    }
    const cancelled = new AbortController();
    res.on('close', () => { if (!res.writableEnded) cancelled.abort(); });
    try {
      await work(run, cancelled.signal);
    } catch {
      return; // Leasehold went away: the run was cancelled, nothing to answer.
    }
    const result = write(run);
    if (!result.ok) return answer(res, 409, { error: result.why });
    console.log(`done ${run.scope}/${run.recordId} token ${run.fencingToken} attempt ${run.attempt}`);
    answer(res, 200, { done: true });
  });
});

server.headersTimeout = 10_000;
server.requestTimeout = 60_000;
server.listen(port, '127.0.0.1', () => {
  console.log(`listening on http://127.0.0.1:${server.address().port}/`);
});
for (const signal of ['SIGTERM', 'SIGINT']) process.on(signal, () => server.close(() => process.exit(0)));
