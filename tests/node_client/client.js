// Calls pdllm's public gRPC API the way a Node.js client would: only the shipped .proto files, loaded at
// run time with @grpc/proto-loader (no generated code). Usage:
//   node client.js HOST:PORT '{"context": "...", "question": "...", "generation": {"gen_length": 8}}'
// Sends `authorization: Bearer $PDLLM_AUTH_TOKEN` when that variable is set. Prints one JSON object:
//   {"health": {"": "SERVING", "pdllm.v1.Generation": ...}, "unary": GenerateResponse,
//    "stream": {"partials": [...], "finals": [...]}}
// where a failed call is {"error": {"code": N, "details": "..."}} instead. Exits 0 unless it crashed.
"use strict";
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = path.resolve(__dirname, "..", "..", "protos");
const DEADLINE_MS = 120000;

function load(file) {
  const def = protoLoader.loadSync(file, {
    includeDirs: [PROTOS],
    keepCase: true, // field names exactly as in the .proto (snake_case)
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true, // a oneof's set member is named in a virtual field (`event`)
  });
  return grpc.loadPackageDefinition(def);
}

const deadline = () => ({ deadline: Date.now() + DEADLINE_MS });
const failure = (err) => ({ error: { code: err.code, details: err.details } });
const unary = (client, method, request, metadata) =>
  new Promise((resolve) =>
    client[method](request, metadata, deadline(), (err, reply) => resolve(err ? failure(err) : reply)),
  );

function stream(client, request, metadata) {
  return new Promise((resolve) => {
    const out = { partials: [], finals: [] };
    const call = client.GenerateStream(request, metadata, deadline());
    call.on("data", (msg) => (msg.event === "partial" ? out.partials : out.finals).push(msg[msg.event]));
    call.on("error", (err) => resolve({ ...out, ...failure(err) }));
    call.on("end", () => resolve(out));
  });
}

async function main() {
  const [address, requestJson] = process.argv.slice(2);
  if (!address || !requestJson) throw new Error("usage: node client.js HOST:PORT REQUEST_JSON");
  const request = JSON.parse(requestJson);
  const creds = grpc.credentials.createInsecure();
  const health = new (load("grpc/health/v1/health.proto").grpc.health.v1.Health)(address, creds);
  const generation = new (load("pdllm/v1/generation.proto").pdllm.v1.Generation)(address, creds);
  const metadata = new grpc.Metadata();
  if (process.env.PDLLM_AUTH_TOKEN) metadata.add("authorization", `Bearer ${process.env.PDLLM_AUTH_TOKEN}`);

  const result = { health: {} };
  for (const service of ["", "pdllm.v1.Generation"]) {
    // Health needs no token, so none is sent: this also checks that auth exempts it.
    const reply = await unary(health, "Check", { service }, new grpc.Metadata());
    result.health[service] = reply.error ? reply : reply.status;
  }
  result.unary = await unary(generation, "Generate", request, metadata);
  result.stream = await stream(generation, request, metadata);
  health.close();
  generation.close();
  process.stdout.write(`${JSON.stringify(result)}\n`);
}

main().catch((err) => {
  console.error(err.stack || String(err));
  process.exit(2);
});
