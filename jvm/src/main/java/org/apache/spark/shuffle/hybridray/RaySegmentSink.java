package org.apache.spark.shuffle.hybridray;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.node.ArrayNode;
import com.fasterxml.jackson.databind.node.ObjectNode;
import io.ray.api.ObjectRef;
import io.ray.api.PyActorHandle;
import io.ray.api.Ray;
import io.ray.api.exception.RayTimeoutException;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.ObjectOutputStream;
import java.nio.ByteBuffer;
import java.nio.channels.SeekableByteChannel;
import java.nio.file.FileAlreadyExistsException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.StandardCopyOption;
import java.nio.file.StandardOpenOption;
import java.nio.file.attribute.PosixFilePermissions;
import java.util.ArrayList;
import java.util.Base64;
import java.util.EnumSet;
import java.util.List;
import java.util.Locale;

/**
 * Stores one map attempt's segments in hybrid_ray's tiers, batch by batch: one space
 * reservation from the node's tier manager for the whole batch (memory first, then disk:
 * the same budgets, reserve fraction and byte cap as the Ray shuffles), the writes
 * ({@code Ray.put} for memory, 0600 files in 0700 directories under the granted spill dir
 * for disk, in the layout of {@code hybrid_ray/tiers/disk.py}), then one commit of the
 * batch's segment metadata to the shuffle master. Settlements of the grants travel with the
 * next reservation, the last ones asynchronously.
 *
 * <p>When neither local tier can take a segment it goes to the shuffle's remote tier,
 * written by the node's tier manager (fsspec: S3 through s3fs, with the session's
 * {@code storage_options}, which never enter Spark's configuration). Without a remote tier
 * the task fails with an error naming the refusals and the settings to change: writing to
 * Spark's local dir instead would break the very disk budget the user set.
 */
final class RaySegmentSink implements SegmentSink {
  static final String DATA_DIR_NAME = "hybrid_ray";
  /** How long an aborting attempt waits for its lease's answer to give the lease back. */
  static final long ABORT_LEASE_WAIT_MS = 1000;
  /** What a shuffle key may be (hybrid_ray's ids, {@code ids.ID_PATTERN}). */
  private static final java.util.regex.Pattern SHUFFLE_KEY =
      java.util.regex.Pattern.compile("[A-Za-z0-9][A-Za-z0-9_.-]{0,127}");

  private final HybridRayContext ctx;
  private final int shuffleId;
  private final String shuffleKey;
  private final int numPartitions;
  private final int mapIndex;
  private final long mapId;
  // Grants whose settling changes the tier manager's books, not sent yet.
  private final List<Settlement> settlements = new ArrayList<>();
  private final List<Path> uncommittedFiles = new ArrayList<>();
  // [partition, index] of remote-tier segments stored but not committed yet: only this
  // attempt knows them, so its abort has the tier manager delete them (the master's abort
  // deletes committed segments only: they stayed in the remote store until the release).
  private final List<int[]> uncommittedRemote = new ArrayList<>();
  // A commit of this attempt went to the master: it may be in the master's books even if
  // its call failed (timed out), so an abort must tell the master. (Set only once a call
  // succeeded, a first commit that timed out and was applied later was never aborted:
  // its segments stayed counted on the node until the shuffle's release.)
  private boolean commitSent;
  // The memory lease asked for when the task started (startLease), until its answer is
  // taken; then the lease itself (null: none asked for, refused, or closed).
  private ObjectRef<String> pendingLease;
  private MemoryLease lease;
  private long bytesStored;
  // Names this sink's reservations on its tier manager (token_writer, token_sequence):
  // one whose call failed (timed out) may still run there and grant space this sink
  // never hears of, so abort() cancels it by its token (spark_cancel_reserve).
  private final String reserveWriter = java.util.UUID.randomUUID().toString();
  private long reserveSequence;
  private long unansweredReserve = -1;

  RaySegmentSink(HybridRayContext ctx, int shuffleId, String shuffleKey, int numPartitions,
      int mapIndex, long mapId) {
    this.ctx = ctx;
    this.shuffleId = shuffleId;
    this.shuffleKey = shuffleKey;
    this.numPartitions = numPartitions;
    this.mapIndex = mapIndex;
    this.mapId = mapId;
  }

  /**
   * Ask the node's tier manager for a memory lease of {@code bytes} without waiting: the
   * task's work overlaps the round trip, and a first batch that fits in the lease needs
   * no reservation call ({@link MemoryLease}). A lease that cannot be asked for or is
   * refused only means the batches reserve as without one.
   */
  void startLease(long bytes) {
    if (bytes <= 0 || pendingLease != null || lease != null) {
      return;
    }
    try {
      ObjectNode request = ctx.json.createObjectNode();
      request.put("shuffle", shuffleKey);
      request.set("config", ctx.configNode());
      request.put("bytes", bytes);
      pendingLease = ctx.callLater(ctx.tierManager(ctx.nodeId()), "spark_lease",
          ctx.toJson(request));
    } catch (IOException | RuntimeException e) {
      pendingLease = null;
    }
  }

  /** The lease's answer, waiting at most {@code waitMs} for it (null: none). */
  private MemoryLease takeLease(long waitMs) {
    ObjectRef<String> pending = pendingLease;
    if (pending == null) {
      return lease;
    }
    pendingLease = null;
    try {
      JsonNode granted = ctx.parse(ctx.awaitWithin(pending, "spark_lease", waitMs)).get("lease");
      if (granted != null && !granted.isNull()) {
        lease = new MemoryLease(granted.get("granted").asLong(), granted.get("target").asText(),
            granted.path("books").asText(""));
      }
    } catch (IOException | RuntimeException e) {
      // No lease (the reservation that follows reports a real problem with its own error).
      // One not answered in time is given back when it is, from the sender (one that
      // failed or answered just now is looked at there too: a grant is settled, an error
      // gives back nothing).
      try {
        ctx.giveBackWhenAnswered(pending, ctx.tierManager(ctx.nodeId()), shuffleKey);
      } catch (IOException | RuntimeException ignored) {
        // Ray is going down with this executor: the grant goes with the shuffle's release.
      }
    }
    return lease;
  }

  /** Close the lease: what it did not place goes back with the next settlements. */
  private void closeLease() {
    if (lease != null) {
      Settlement rest = lease.leftover();
      if (rest != null) {
        settlements.add(rest);
      }
      lease = null;
    }
  }

  @Override
  public void store(List<PartitionSegmenter.Segment> segments, boolean last) throws IOException {
    if (segments.isEmpty() && !last) {
      return;
    }
    String node = ctx.nodeId();
    PyActorHandle tierManager = ctx.tierManager(node);
    ArrayNode stored = ctx.json.createArrayNode();
    // The batch's grants and which were used: settled once the commit's fate is known.
    JsonNode batchPlacements = null;
    boolean[] batchUsed = null;
    if (!segments.isEmpty()) {
      int n = segments.size();
      int[] frameSizes = new int[n];
      for (int i = 0; i < n; i++) {
        frameSizes[i] = segments.get(i).frame().length;
        bytesStored += frameSizes[i];
      }
      MemoryLease leased = takeLease(ctx.callTimeoutMs);
      JsonNode placements;
      boolean hasRemote;
      if (leased != null && leased.take(frameSizes)) {
        // The whole batch goes to memory within the lease: no reservation call.
        ArrayNode local = ctx.json.createArrayNode();
        for (int i = 0; i < n; i++) {
          local.addObject().put("tier", "memory").put("target", leased.target())
              .put("settle_if_written", false).put("books", leased.books());
        }
        placements = local;
        hasRemote = false;
      } else {
        closeLease();  // what is left of it goes back with this reservation
        ObjectNode request = ctx.json.createObjectNode();
        request.put("shuffle", shuffleKey);
        request.set("config", ctx.configNode());
        ArrayNode sizes = request.putArray("sizes");
        for (int size : frameSizes) {
          sizes.add(size);
        }
        request.set("settle", settlementsJson());
        settlements.clear();
        long sequence = ++reserveSequence;
        request.put("token_writer", reserveWriter);
        request.put("token_sequence", sequence);
        JsonNode answer;
        try {
          answer = ctx.parse(ctx.call(tierManager, "spark_reserve", ctx.toJson(request)));
        } catch (IOException | RuntimeException e) {
          unansweredReserve = sequence;
          throw e;
        }
        placements = answer.get("placements");
        hasRemote = answer.path("remote").asBoolean(false);
      }
      String[] tiers = new String[n];
      String[] locations = new String[n];
      // Whether segment i's grant was used (its bytes are written): settled with its size.
      boolean[] used = new boolean[n];
      List<Integer> memory = new ArrayList<>();
      try {
        for (int i = 0; i < n; i++) {
          PartitionSegmenter.Segment s = segments.get(i);
          JsonNode p = placements.get(i);
          if (p.get("tier").isNull()) {
            if (!hasRemote) {
              throw new IOException(outOfSpace(s, p.get("refusals")));
            }
            // Neither local tier has room: the node's tier manager stores it remotely.
            tiers[i] = "remote";
            // Noted first: a write whose call failed (timed out) may still land.
            uncommittedRemote.add(new int[] {s.partition(), s.index()});
            locations[i] = writeRemote(tierManager, s);
          } else if (p.get("tier").asText().equals("memory")) {
            memory.add(i);  // put below, small ones together in one object
          } else {
            tiers[i] = p.get("tier").asText();
            Path path = segmentPath(p.get("target").asText(), s);
            writePrivateFile(path, s.frame());
            uncommittedFiles.add(path);
            locations[i] = path.toString();
            used[i] = true;
          }
        }
        putMemorySegments(segments, memory, tiers, locations, used);
      } catch (IOException | RuntimeException e) {
        // Nothing of this batch will be committed: abort() deletes its files and drops its
        // objects, so every grant of it goes back, the written ones too (settled as
        // written, their space stayed counted with nothing left to free it).
        settle(segments, placements, new boolean[n]);
        throw e;
      }
      batchPlacements = placements;
      batchUsed = used;
      for (int i = 0; i < n; i++) {
        PartitionSegmenter.Segment s = segments.get(i);
        // The books that granted its space (none for the remote tier): a tier manager
        // started again frees it without giving back bytes it never counted.
        String books = "remote".equals(tiers[i]) ? "" : placements.get(i).path("books").asText("");
        stored.addArray().add(s.partition()).add(s.index()).add(tiers[i])
            .add(s.frame().length).add(locations[i]).add(books);
      }
    }
    ObjectNode commit = ctx.json.createObjectNode();
    commit.put("shuffle", shuffleKey);
    commit.set("config", ctx.configNode());
    commit.put("num_partitions", numPartitions);
    commit.put("map_index", mapIndex);
    commit.put("map_id", mapId);
    commit.put("node", node);
    commit.put("executor", ctx.executorId);  // its attempts go when Spark removes it
    commit.put("final", last);
    commit.set("segments", stored);
    commitSent = true;
    try {
      if (last) {
        // Not waited for: the task's MapStatus usually reaches a reader long after this
        // commit reaches the master, which holds a reader asking earlier until it is in
        // (spark_await_blocks, up to commitWaitMs); one that fails is logged and leaves
        // the attempt missing, so its readers raise FetchFailedException and Spark
        // recomputes it. Earlier commits of a map are waited for: the master is
        // threaded, and the last must come last.
        ctx.commitLater(ctx.master(), ctx.toJson(commit),
            "map attempt " + mapId + " (map " + mapIndex + ") of Spark shuffle " + shuffleKey,
            shuffleId, mapId);
      } else {
        ctx.call(ctx.master(), "spark_commit", ctx.toJson(commit));
      }
    } catch (IOException | RuntimeException e) {
      if (batchPlacements != null) {
        // Refused: abort() deletes the batch's files and drops its objects, so its grants
        // go back in full. Timed out: the master may still apply the commit, and its abort
        // then frees the segments: settled as written, not given back twice.
        boolean mayBeApplied = timedOut(e);
        settle(segments, batchPlacements,
            mayBeApplied ? batchUsed : new boolean[batchUsed.length]);
      }
      throw e;
    }
    if (batchPlacements != null) {
      settle(segments, batchPlacements, batchUsed);
    }
    uncommittedFiles.clear();
    uncommittedRemote.clear();
    if (last) {
      takeLease(ctx.callTimeoutMs);  // (a task with no segments never took its answer)
      closeLease();
      ctx.noteMapBytes(shuffleId, bytesStored);
      if (!settlements.isEmpty()) {
        sendSettlements(tierManager);
      }
    }
  }

  /**
   * {@code Ray.put} the memory-tier segments {@code memory} (indices into {@code segments}),
   * consecutive small ones together in one object of at most {@code packBytes}
   * ({@link MemoryPacking}): one object store round trip per group instead of per segment.
   */
  private void putMemorySegments(List<PartitionSegmenter.Segment> segments,
      List<Integer> memory, String[] tiers, String[] locations, boolean[] used)
      throws IOException {
    int[] sizes = new int[memory.size()];
    for (int k = 0; k < sizes.length; k++) {
      sizes[k] = segments.get(memory.get(k)).frame().length;
    }
    for (int[] group : MemoryPacking.groups(sizes, ctx.packBytes)) {
      List<byte[]> frames = new ArrayList<>(group.length);
      for (int k : group) {
        frames.add(segments.get(memory.get(k)).frame());
      }
      byte[] object = group.length == 1 ? frames.get(0) : MemoryPacking.concat(frames);
      ObjectRef<byte[]> ref = Ray.put(object);
      ctx.own(shuffleId, mapId, ref);
      String where = Base64.getEncoder().encodeToString(serializeRef(ref));
      int offset = 0;
      for (int k : group) {
        int i = memory.get(k);
        int length = segments.get(i).frame().length;
        tiers[i] = "memory";
        locations[i] = group.length == 1 ? where
            : MemoryPacking.location(where, offset, length);
        used[i] = true;
        offset += length;
      }
    }
  }

  /**
   * Queue the settlements of a batch's grants that change the tier manager's books: every
   * grant not used (its space goes back), and a used one only if the tier manager said so
   * with the grant ({@code settle_if_written}: disk grants are in flight until settled).
   * A memory grant written in full changes nothing there: no settlement, and a map task
   * whose segments all went to memory makes no settle call.
   */
  private void settle(List<PartitionSegmenter.Segment> segments, JsonNode placements,
      boolean[] used) {
    for (int i = 0; i < segments.size(); i++) {
      JsonNode p = placements.get(i);
      if (p.get("tier").isNull()) {
        continue;
      }
      String tier = p.get("tier").asText();
      int granted = segments.get(i).frame().length;
      if (used[i] && !p.path("settle_if_written").asBoolean(true)) {
        continue;
      }
      settlements.add(new Settlement(tier, granted, p.get("target").asText(),
          used[i] ? granted : -1, p.path("books").asText("")));
    }
  }

  /** Whether {@code e} is a call that ran out of time (its answer may still come). */
  static boolean timedOut(Throwable e) {
    return HybridRayContext.causedBy(e, RayTimeoutException.class);
  }

  /** What became of a grant: its tier, size and target as granted, the bytes written
   *  (-1: none, the space goes back) and the books that granted it (the tier manager's
   *  {@code books_id}; "" if unnamed: a tier manager started again after one died ignores
   *  its predecessor's). The tier manager keeps no record of its grants. */
  record Settlement(String tier, long granted, String target, long written, String books) {
  }

  @Override
  public void abort(Throwable cause) {
    for (Path path : uncommittedFiles) {
      try {
        Files.deleteIfExists(path);
      } catch (IOException ignored) {
        // The master's release removes the shuffle's directory anyway.
      }
    }
    uncommittedFiles.clear();
    ctx.dropAttempt(shuffleId, mapId);
    // A lease still in flight is waited for briefly, to give it back now; one that answers
    // later is given back from the sender when it does (HybridRayContext.lateLeases).
    takeLease(ABORT_LEASE_WAIT_MS);
    closeLease();
    try {
      if (unansweredReserve >= 0) {
        // From the sender, after the reservation it cancels (one caller, one actor: Ray
        // runs the calls in the order they were sent).
        ObjectNode cancel = ctx.json.createObjectNode();
        cancel.put("shuffle", shuffleKey);
        cancel.put("token_writer", reserveWriter);
        cancel.put("token_sequence", unansweredReserve);
        unansweredReserve = -1;
        ctx.callAsync(ctx.tierManager(ctx.nodeId()), "spark_cancel_reserve",
            ctx.toJson(cancel));
      }
      if (!settlements.isEmpty()) {
        sendSettlements(ctx.tierManager(ctx.nodeId()));
      }
      if (!uncommittedRemote.isEmpty()) {
        sendRemoteDeletes(ctx.tierManager(ctx.nodeId()));
      }
      if (commitSent) {
        ObjectNode request = ctx.json.createObjectNode();
        request.put("shuffle", shuffleKey);
        request.put("map_id", mapId);
        // From the sender, after this attempt's last commit if that is still queued
        // there (sent directly, the abort could pass it, leaving a finished attempt
        // nobody reads holding its data until the shuffle's release).
        ctx.callAsync(ctx.master(), "spark_abort", ctx.toJson(request));
      }
    } catch (IOException | RuntimeException ignored) {
      // Best effort: a failed attempt's data goes with its shuffle's release at the latest.
    }
  }

  /** Store {@code s} in the shuffle's remote tier through the node's tier manager (its
   *  fsspec filesystem: no Hadoop S3A here); returns the segment's location. */
  private String writeRemote(PyActorHandle tierManager, PartitionSegmenter.Segment s)
      throws IOException {
    ObjectNode request = ctx.json.createObjectNode();
    request.put("shuffle", shuffleKey);
    request.put("map_index", mapIndex);
    request.put("map_id", mapId);
    request.put("partition", s.partition());
    request.put("index", s.index());
    String answer = ctx.callWithBytes(tierManager, "spark_write_remote", ctx.toJson(request),
        s.frame());
    return ctx.parse(answer).get("location").asText();
  }

  /** Have the tier manager delete the remote segments this attempt stored but never
   *  committed (from the sender: nobody waits for it). */
  private void sendRemoteDeletes(PyActorHandle tierManager) throws IOException {
    ObjectNode request = ctx.json.createObjectNode();
    request.put("shuffle", shuffleKey);
    request.put("map_index", mapIndex);
    request.put("map_id", mapId);
    ArrayNode list = request.putArray("segments");
    for (int[] segment : uncommittedRemote) {
      list.addArray().add(segment[0]).add(segment[1]);
    }
    uncommittedRemote.clear();
    ctx.callAsync(tierManager, "spark_delete_remote", ctx.toJson(request));
  }

  private ArrayNode settlementsJson() {
    ArrayNode out = ctx.json.createArrayNode();
    for (Settlement s : settlements) {
      ArrayNode entry = out.addArray().add(s.tier()).add(s.granted()).add(s.target());
      if (s.written() < 0) {
        entry.addNull();
      } else {
        entry.add(s.written());
      }
      entry.add(s.books() == null ? "" : s.books());
    }
    return out;
  }

  private void sendSettlements(PyActorHandle tierManager) throws IOException {
    ObjectNode request = ctx.json.createObjectNode();
    request.put("shuffle", shuffleKey);
    request.set("settle", settlementsJson());
    settlements.clear();
    ctx.callAsync(tierManager, "spark_settle", ctx.toJson(request));
  }

  private String outOfSpace(PartitionSegmenter.Segment s, JsonNode refusals) {
    StringBuilder why = new StringBuilder();
    for (JsonNode r : refusals) {
      why.append(why.length() == 0 ? "" : "; ").append(r.asText());
    }
    return "hybrid_ray: no tier can take a segment of " + s.frame().length + " bytes of "
        + "Spark shuffle " + shuffleKey + " on node " + ctx.nodeId() + " (" + why + "). "
        + "Give the disk tier room (ShuffleConfig spill_dirs on a larger disk, "
        + "disk_capacity_bytes, min_reserve_fraction), the memory tier more "
        + "(memory_fraction), or the shuffle a remote tier (ShuffleConfig remote_path, "
        + "passed to spark_bridge.init_spark as shuffle_config)";
  }

  /** {@code <spill dir>/hybrid_ray/<shuffle>/sub-<partition>/m<map>-a<attempt>-s<index>.seg}. */
  Path segmentPath(String spillDir, PartitionSegmenter.Segment s) {
    return segmentPath(spillDir, shuffleKey, mapIndex, mapId, s.partition(), s.index());
  }

  static Path segmentPath(String spillDir, String shuffleKey, int mapIndex, long mapId,
      int partition, int index) {
    // The directory is a tier manager's grant and the key comes with the task's handle,
    // both from other processes: as the reader confines what it opens
    // (LocalSegmentFiles), the writer confines what it creates. A relative target was
    // written below the executor's working directory, a key with a separator or ".."
    // outside the shuffle's directory (where no release removes it), and a negative
    // number named another segment's file.
    Path dir;
    try {
      dir = Paths.get(spillDir);
    } catch (java.nio.file.InvalidPathException e) {
      throw new IllegalArgumentException("hybrid_ray: a disk grant's target '" + spillDir
          + "' is not a valid path", e);
    }
    if (!dir.isAbsolute() || !dir.equals(dir.normalize())) {
      throw new IllegalArgumentException("hybrid_ray: a disk grant's target '" + spillDir
          + "' is not an absolute path without '..'; a segment file is only written below "
          + "a spill dir");
    }
    if (shuffleKey == null || !SHUFFLE_KEY.matcher(shuffleKey).matches()) {
      throw new IllegalArgumentException("hybrid_ray: shuffle key '" + shuffleKey + "' is "
          + "not an id ([A-Za-z0-9][A-Za-z0-9_.-]{0,127}); it cannot name a directory");
    }
    if (mapIndex < 0 || mapId < 0 || partition < 0 || index < 0) {
      throw new IllegalArgumentException("hybrid_ray: negative map index, attempt, "
          + "partition or segment index (" + mapIndex + ", " + mapId + ", " + partition
          + ", " + index + ") in a segment file name");
    }
    // Locale.ROOT: ASCII digits whatever the executor's locale (see segmentPath's test).
    return dir.resolve(DATA_DIR_NAME).resolve(shuffleKey).resolve(
        String.format(Locale.ROOT, "sub-%05d", partition)).resolve(
        String.format(Locale.ROOT, "m%06d-a%03d-s%06d.seg", mapIndex, mapId, index));
  }

  /** Create missing directories below {@code <spill>/hybrid_ray} as 0700, then write the
   *  file as 0600 under a temporary name and rename it into place (never half visible). */
  static void writePrivateFile(Path path, byte[] data) throws IOException {
    makePrivateDir(path.getParent());
    Path tmp = path.resolveSibling(path.getFileName() + "." + ProcessHandle.current().pid()
        + ".inprogress");
    try {
      try (SeekableByteChannel ch = Files.newByteChannel(tmp,
          EnumSet.of(StandardOpenOption.CREATE, StandardOpenOption.TRUNCATE_EXISTING,
              StandardOpenOption.WRITE),
          PosixFilePermissions.asFileAttribute(PosixFilePermissions.fromString("rw-------")))) {
        ByteBuffer buf = ByteBuffer.wrap(data);
        while (buf.hasRemaining()) {
          ch.write(buf);
        }
      }
      Files.move(tmp, path, StandardCopyOption.ATOMIC_MOVE, StandardCopyOption.REPLACE_EXISTING);
    } catch (IOException e) {
      Files.deleteIfExists(tmp);
      if (String.valueOf(e.getMessage()).contains("No space left")) {
        throw new IOException("hybrid_ray: no space left in " + path.getParent() + " while "
            + "writing a Spark shuffle segment of " + data.length + " bytes (the disk filled "
            + "after the grant: other processes write there too; raise min_reserve_fraction)",
            e);
      }
      throw e;
    }
  }

  static void makePrivateDir(Path dir) throws IOException {
    if (Files.isDirectory(dir)) {
      return;
    }
    makePrivateDir(dir.getParent());
    try {
      Files.createDirectory(dir,
          PosixFilePermissions.asFileAttribute(PosixFilePermissions.fromString("rwx------")));
    } catch (FileAlreadyExistsException ignored) {
      // Another task of the shuffle made it first.
    }
  }

  static byte[] serializeRef(ObjectRef<byte[]> ref) throws IOException {
    ByteArrayOutputStream bytes = new ByteArrayOutputStream(128);
    try (ObjectOutputStream out = new ObjectOutputStream(bytes)) {
      out.writeObject(ref);
    }
    return bytes.toByteArray();
  }
}
