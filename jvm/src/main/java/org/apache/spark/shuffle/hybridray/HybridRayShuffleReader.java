package org.apache.spark.shuffle.hybridray;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.node.ArrayNode;
import com.fasterxml.jackson.databind.node.ObjectNode;
import io.ray.api.ObjectRef;
import io.ray.api.PyActorHandle;
import io.ray.api.Ray;
import io.ray.api.exception.RayActorException;
import io.ray.api.exception.RayTimeoutException;
import java.io.ByteArrayInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.ObjectInputFilter;
import java.io.ObjectInputStream;
import java.io.SequenceInputStream;
import java.nio.file.NoSuchFileException;
import java.util.ArrayList;
import java.util.Base64;
import java.util.Collections;
import java.util.Enumeration;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.NoSuchElementException;
import java.util.Optional;
import org.apache.spark.Aggregator;
import org.apache.spark.InterruptibleIterator;
import org.apache.spark.ShuffleDependency;
import org.apache.spark.SparkEnv;
import org.apache.spark.TaskContext;
import org.apache.spark.serializer.SerializerInstance;
import org.apache.spark.shuffle.BaseShuffleHandle;
import org.apache.spark.shuffle.FetchFailedException;
import org.apache.spark.shuffle.ShuffleReadMetricsReporter;
import org.apache.spark.shuffle.ShuffleReader;
import org.apache.spark.storage.BlockId;
import org.apache.spark.storage.BlockManagerId;
import org.apache.spark.storage.ShuffleBlockId;
import org.apache.spark.util.collection.ExternalSorter;
import scala.Option;
import scala.Product2;
import scala.Tuple2;
import scala.Tuple3;
import scala.collection.AbstractIterator;
import scala.collection.Iterator;

/**
 * Reads reduce partitions {@code [startPartition, endPartition)} of maps
 * {@code [startMapIndex, endMapIndex)} (AQE's coalesced and skew-split reads), exactly as
 * Spark's {@code BlockStoreShuffleReader} does past the fetch: Spark's compression and
 * serializer, then the dependency's aggregation and key ordering.
 *
 * <p>Which attempt of each map counts is Spark's decision: the blocks come from the
 * {@code MapOutputTracker} (a map's {@code mapId} is the task attempt that Spark accepted),
 * so a failed, killed or speculative loser attempt is never read. Their segments come from
 * the shuffle master in one call, sent before the tracker is asked (the two round trips
 * overlap); a segment that is gone, unreadable or fails its checksum raises
 * {@code FetchFailedException}, so Spark recomputes that map. A local disk segment
 * whose path lies outside this node's spill dirs is never opened
 * ({@link LocalSegmentFiles}): the task fails with an error naming the path and the allowed
 * directories (not a fetch failure: recomputing the map would not make the path safe).
 */
final class HybridRayShuffleReader<K, C> implements ShuffleReader<K, C> {
  private final HybridRayContext ctx;
  private final BaseShuffleHandle<K, ?, C> handle;
  private final String shuffleKey;
  private final int startMapIndex;
  private final int endMapIndex;
  private final int startPartition;
  private final int endPartition;
  private final TaskContext context;
  private final ShuffleReadMetricsReporter metrics;

  /** One block: one reduce partition of one map attempt. */
  private record Block(BlockManagerId address, long mapId, int mapIndex, int reduceId) {}

  HybridRayShuffleReader(HybridRayContext ctx, BaseShuffleHandle<K, ?, C> handle,
      int startMapIndex, int endMapIndex, int startPartition, int endPartition,
      TaskContext context, ShuffleReadMetricsReporter metrics) {
    this.ctx = ctx;
    this.handle = handle;
    this.shuffleKey = ((HybridRayHandle) handle).shuffleKey();
    this.startMapIndex = startMapIndex;
    this.endMapIndex = endMapIndex;
    this.startPartition = startPartition;
    this.endPartition = endPartition;
    this.context = context;
    this.metrics = metrics;
  }

  /** Bounds of one batched memory-tier fetch (see {@code prefetchMemorySegments}). */
  static final long PREFETCH_BYTES = 64L << 20;
  static final int PREFETCH_REFS = 1024;

  @Override
  @SuppressWarnings({"unchecked", "rawtypes"})
  public Iterator<Product2<K, C>> read() {
    ShuffleDependency<K, ?, C> dep = handle.dependency();
    // Ask the master for the segments while Spark's MapOutputTracker says which attempts
    // count: two round trips at once instead of one after the other.
    PendingLocate pending = locateAll();
    List<Block> blocks = blocks();
    List<JsonNode> where = locate(blocks, pending);
    Iterator<Product2<Object, Object>> records =
        new RecordIterator(blocks, where, dep.serializer().newInstance());
    Iterator interruptible = new InterruptibleIterator(context, records);
    Iterator aggregated;
    Option<Aggregator<K, ?, C>> aggregator = (Option) dep.aggregator();
    if (aggregator.isDefined()) {
      Aggregator agg = aggregator.get();
      aggregated = dep.mapSideCombine()
          ? agg.combineCombinersByKey(interruptible, context)
          : agg.combineValuesByKey(interruptible, context);
    } else {
      aggregated = interruptible;
    }
    Iterator result = aggregated;
    if (dep.keyOrdering().isDefined()) {
      ExternalSorter sorter = new ExternalSorter(context, Option.empty(), Option.empty(),
          dep.keyOrdering(), dep.serializer());
      result = sorter.insertAllAndUpdateMetrics(aggregated);
    }
    return result instanceof InterruptibleIterator ? result
        : new InterruptibleIterator(context, result);
  }

  /** The accepted attempts' non-empty blocks in range, from Spark's MapOutputTracker. */
  private List<Block> blocks() {
    List<Block> out = new ArrayList<>();
    Iterator<Tuple2<BlockManagerId, scala.collection.Seq<Tuple3<BlockId, Object, Object>>>> it =
        SparkEnv.get().mapOutputTracker().getMapSizesByExecutorId(handle.shuffleId(),
            startMapIndex, endMapIndex, startPartition, endPartition);
    while (it.hasNext()) {
      Tuple2<BlockManagerId, scala.collection.Seq<Tuple3<BlockId, Object, Object>>> byAddress =
          it.next();
      Iterator<Tuple3<BlockId, Object, Object>> ids = byAddress._2().iterator();
      while (ids.hasNext()) {
        Tuple3<BlockId, Object, Object> t = ids.next();
        ShuffleBlockId id = (ShuffleBlockId) t._1();
        out.add(new Block(byAddress._1(), id.mapId(), (Integer) t._3(), id.reduceId()));
      }
    }
    // Map order, then partition: the order Spark's own reader sees for a local fetch.
    out.sort((a, b) -> a.mapIndex != b.mapIndex ? Integer.compare(a.mapIndex, b.mapIndex)
        : Integer.compare(a.reduceId, b.reduceId));
    return out;
  }

  /** A locate call in flight, or why it could not be sent. */
  private record PendingLocate(ObjectRef<String> answer, IOException failure) {}

  /** One block's key in the master's answer. */
  private record BlockKey(long mapId, int reduceId) {}

  /**
   * Send the master the read's whole range (map indices and partitions), not yet knowing
   * which attempts Spark accepted: the answer holds every finished attempt's blocks in it,
   * and {@link #locate} keeps those of the attempts Spark lists.
   */
  private PendingLocate locateAll() {
    try {
      ObjectNode request = ctx.json.createObjectNode();
      request.put("shuffle", shuffleKey);
      request.putArray("maps").add(startMapIndex).add(endMapIndex);
      request.putArray("partitions").add(startPartition).add(endPartition);
      return new PendingLocate(
          ctx.callLater(ctx.master(), "spark_locate", ctx.toJson(request)), null);
    } catch (IOException | RuntimeException e) {
      return new PendingLocate(null, e instanceof IOException io ? io : new IOException(e));
    }
  }

  /** Each block's segments ([tier, bytes, node, location] in index order), or null. */
  private List<JsonNode> locate(List<Block> blocks, PendingLocate pending) {
    if (blocks.isEmpty()) {
      return Collections.emptyList();  // (an answer still in flight is dropped)
    }
    try {
      if (pending.failure() != null) {
        throw pending.failure();
      }
      JsonNode answer = ctx.parse(ctx.await(pending.answer(), "spark_locate"));
      Map<BlockKey, JsonNode> found = new HashMap<>();
      for (JsonNode entry : answer.get("attempts")) {
        found.put(new BlockKey(entry.get(0).asLong(), entry.get(1).asInt()), entry.get(2));
      }
      List<JsonNode> out = new ArrayList<>(blocks.size());
      List<Integer> missing = new ArrayList<>();
      for (Block b : blocks) {
        JsonNode segments = found.get(new BlockKey(b.mapId, b.reduceId));
        if (segments == null) {
          missing.add(out.size());
        }
        out.add(segments);
      }
      // Not finished when the master answered: an attempt whose last commit (sent by
      // its task without waiting) is not in yet, or one lost. Ask again for exactly those
      // blocks, letting the master wait for them, up to commitWaitMs; still null: lost.
      // A block the master says is lost fails the fetch at once, naming that block: not
      // the first missing one, whose last commit may still be on its way (blaming it made
      // Spark drop a healthy executor's outputs while the lost map stayed registered).
      long deadline = System.nanoTime() + ctx.commitWaitMs * 1_000_000L;
      while (!missing.isEmpty()) {
        long leftMs = (deadline - System.nanoTime()) / 1_000_000L;
        ObjectNode request = ctx.json.createObjectNode();
        request.put("shuffle", shuffleKey);
        request.put("wait_s", Math.max(0, Math.min(leftMs, 1000)) / 1000.0);
        ArrayNode list = request.putArray("blocks");
        for (int i : missing) {
          list.addArray().add(blocks.get(i).mapId).add(blocks.get(i).reduceId);
        }
        JsonNode reply = ctx.parse(ctx.call(ctx.master(), "spark_await_blocks",
            ctx.toJson(request)));
        JsonNode again = reply.get("blocks");
        List<Integer> still = new ArrayList<>();
        for (int k = 0; k < missing.size(); k++) {
          out.set(missing.get(k), again.get(k));
          if (again.get(k) == null || again.get(k).isNull()) {
            still.add(missing.get(k));
          }
        }
        int lost = lostIndex(reply, missing.size());
        if (lost >= 0) {
          Block b = blocks.get(missing.get(lost));
          throw sneaky(new FetchFailedException(b.address, handle.shuffleId(), b.mapId,
              b.mapIndex, b.reduceId, "hybrid_ray: the shuffle master holds no segments of "
                  + describe(b) + " (the attempt finished or was aborted without it)", null));
        }
        missing = still;
        if (leftMs <= 0 || !reply.path("awaited").asBoolean(false)) {
          break;
        }
      }
      return out;
    } catch (IOException e) {
      if (isControlPlaneFault(e)) {
        // The master did not answer (timed out, or died): nothing says the map outputs
        // are gone, and a FetchFailedException would make Spark drop every output of the
        // first block's executor, for every shuffle, and recompute them. Fail this task
        // instead; Spark runs it again (spark.task.maxFailures).
        throw sneaky(new IOException("hybrid_ray: the shuffle master did not answer where "
            + "the segments of Spark shuffle " + shuffleKey + " are: " + e.getMessage(), e));
      }
      Block b = blocks.get(0);
      throw sneaky(new FetchFailedException(b.address, handle.shuffleId(), b.mapId, b.mapIndex,
          b.reduceId, "hybrid_ray: cannot locate the segments of Spark shuffle "
              + shuffleKey + ": " + e.getMessage(), e));
    }
  }

  /**
   * Which of the {@code asked} blocks of a {@code spark_await_blocks} answer to blame: the
   * first of its {@code lost} indices (blocks whose attempt finished or was aborted
   * without them, so no commit of theirs will come), or -1 if none is lost (an index out
   * of range is ignored).
   */
  static int lostIndex(JsonNode reply, int asked) {
    for (JsonNode i : reply.path("lost")) {
      if (i.canConvertToInt() && i.asInt() >= 0 && i.asInt() < asked) {
        return i.asInt();
      }
    }
    return -1;
  }

  /** A block, as messages name it. */
  private String describe(Block b) {
    return "block (map " + b.mapIndex + ", attempt " + b.mapId + ", partition "
        + b.reduceId + ") of Spark shuffle " + shuffleKey;
  }

  /** Records of the blocks in order; each block is fetched when the previous one is done. */
  private final class RecordIterator extends AbstractIterator<Product2<Object, Object>> {
    private final List<Block> blocks;
    private final List<JsonNode> where;
    private final SerializerInstance serializer;
    private int next;
    private Iterator<Tuple2<Object, Object>> current;

    private boolean merged;

    RecordIterator(List<Block> blocks, List<JsonNode> where, SerializerInstance serializer) {
      this.blocks = blocks;
      this.where = where;
      this.serializer = serializer;
    }

    @Override
    public boolean hasNext() {
      while (current == null || !current.hasNext()) {
        if (next >= blocks.size()) {
          if (!merged) {
            // As Spark's own reader does at its end: fold this reader's metrics into the
            // task's (without it, the UI, event log and listeners saw no shuffle read).
            merged = true;
            context.taskMetrics().mergeShuffleReadMetrics();
          }
          return false;
        }
        Block b = blocks.get(next);
        prefetchMemorySegments(where, next);
        InputStream in = fetch(b, where.get(next));
        next++;
        InputStream wrapped = SparkEnv.get().serializerManager()
            .wrapStream(new ShuffleBlockId(handle.shuffleId(), b.mapId, b.reduceId), in);
        current = serializer.deserializeStream(wrapped).asKeyValueIterator();
      }
      return true;
    }

    @Override
    public Product2<Object, Object> next() {
      if (!hasNext()) {
        throw new NoSuchElementException();
      }
      metrics.incRecordsRead(1);
      return current.next();
    }
  }

  // Memory-tier objects fetched ahead, by object location (serialized ref), with how many
  // of the fetched blocks' segments still lie in each (packed objects hold several).
  private final Map<String, byte[]> prefetched = new HashMap<>();
  private final Map<String, Integer> prefetchedUses = new HashMap<>();
  private int prefetchedUpTo;
  // Objects of a prefetch batch that timed out: their own fetch gets only
  // AFTER_BATCH_TIMEOUT_MS more (see fetchTimeoutMs), so a stuck object costs the task
  // fetchTimeoutMs once, not twice.
  private final java.util.Set<String> timedOutObjects = new java.util.HashSet<>();

  /** How long the per-segment fetch of an object waits once its batch timed out. */
  static final long AFTER_BATCH_TIMEOUT_MS = 1000;

  /**
   * The wait of one object's own fetch: the whole {@code fetchTimeoutMs}, or, for an
   * object whose prefetch batch already waited that long, {@link #AFTER_BATCH_TIMEOUT_MS}
   * (objects that arrived meanwhile come back at once; the stuck one fails).
   */
  static long fetchTimeoutMs(long fetchTimeoutMs, boolean batchTimedOut) {
    return batchTimedOut ? Math.min(fetchTimeoutMs, AFTER_BATCH_TIMEOUT_MS) : fetchTimeoutMs;
  }

  /**
   * Fetch the memory-tier objects of the blocks from {@code from} on with one
   * {@code Ray.get} of many refs, up to {@link #PREFETCH_BYTES} or {@link #PREFETCH_REFS}:
   * one round trip to the object store instead of one per segment (segments are small
   * when a map's output is spread over many partitions). An object holding several
   * segments ({@link MemoryPacking}) is fetched once. A batch that fails is left to the
   * per-segment path, which names the lost block in its FetchFailedException.
   */
  private void prefetchMemorySegments(List<JsonNode> where, int from) {
    if (from < prefetchedUpTo) {
      return;
    }
    Map<String, Integer> uses = new HashMap<>();
    List<String> objects = new ArrayList<>();
    List<ObjectRef<byte[]>> refs = new ArrayList<>();
    int slices = 0;
    long bytes = 0;
    int i = from;
    for (; i < where.size() && bytes < PREFETCH_BYTES && refs.size() < PREFETCH_REFS; i++) {
      JsonNode segments = where.get(i);
      if (segments == null || segments.isNull()) {
        continue;
      }
      for (JsonNode seg : segments) {
        if (bytes >= PREFETCH_BYTES) {
          break;  // the rest of a large block is fetched segment by segment, as read
        }
        if (seg.get(0).asText().equals("memory")) {
          String object = MemoryPacking.objectLocation(seg.get(3).asText());
          if (uses.merge(object, 1, Integer::sum) == 1) {
            try {
              refs.add(decodeRef(object));
            } catch (IOException e) {
              prefetchedUpTo = i;
              return;  // the per-segment path reports it
            }
            objects.add(object);
          }
          slices++;
          bytes += seg.get(1).asLong();
        }
      }
    }
    prefetchedUpTo = i;
    if (slices < 2) {
      return;
    }
    try {
      List<byte[]> frames = Ray.get(refs, ctx.fetchTimeoutMs);
      for (int k = 0; k < frames.size(); k++) {
        prefetched.put(objects.get(k), frames.get(k));
        prefetchedUses.merge(objects.get(k), uses.get(objects.get(k)), Integer::sum);
      }
    } catch (RayTimeoutException e) {
      // Each segment is fetched (and named) alone, without waiting that long again.
      timedOutObjects.addAll(objects);
    } catch (RuntimeException e) {
      // Some object is gone: each segment is fetched (and named) alone.
      prefetched.clear();
      prefetchedUses.clear();
    }
  }

  /** A prefetched object, dropped once the last of its fetched segments is taken. */
  private byte[] takePrefetched(String object) {
    byte[] bytes = prefetched.get(object);
    if (bytes != null && prefetchedUses.merge(object, -1, Integer::sum) <= 0) {
      prefetched.remove(object);
      prefetchedUses.remove(object);
    }
    return bytes;
  }

  /**
   * What a memory-tier location may deserialize to: a Ray object ref (its id, its type
   * {@code byte[]}), nothing else. Locations come from the master's books; Java
   * deserialization of any other class could run that class's code in the executor.
   */
  static final ObjectInputFilter REF_FILTER = ObjectInputFilter.Config.createFilter(
      "maxdepth=4;maxrefs=16;maxbytes=4096;io.ray.runtime.object.ObjectRefImpl;"
          + "io.ray.api.id.ObjectId;io.ray.api.id.BaseId;[B;!*");

  @SuppressWarnings("unchecked")
  static ObjectRef<byte[]> decodeRef(String location) throws IOException {
    byte[] serialized;
    try {
      serialized = Base64.getDecoder().decode(location);
    } catch (IllegalArgumentException e) {
      throw new IOException("cannot decode an object reference: not base64", e);
    }
    try (ObjectInputStream in = new ObjectInputStream(new ByteArrayInputStream(serialized))) {
      in.setObjectInputFilter(REF_FILTER);
      return (ObjectRef<byte[]>) in.readObject();
    } catch (ClassNotFoundException | ClassCastException e) {
      throw new IOException("cannot decode an object reference", e);
    }
  }

  /**
   * A block's bytes: its segments fetched from their tiers and verified, in order, one at a
   * time as the block is read. Fetched all at once, a skewed block (one map's gigabytes for
   * one reducer) had to fit in the executor's heap; now about one segment of it does. A
   * segment that fails part-way through a block raises FetchFailedException from the
   * stream: the reduce task fails as a whole and Spark runs the map (and the task) again,
   * so no row of the failed block is kept.
   */
  private InputStream fetch(Block b, JsonNode segments) {
    String what = describe(b);
    // Spark lists only non-empty blocks, so a block without segments lost them.
    if (segments == null || segments.isNull() || segments.size() == 0) {
      throw sneaky(new FetchFailedException(b.address, handle.shuffleId(), b.mapId, b.mapIndex,
          b.reduceId, "hybrid_ray: the shuffle master holds no segments of " + what
              + " (the attempt's output was lost or released)", null));
    }
    int[] local = {0};  // segments of the block read from this node
    return new SequenceInputStream(new LazySegments(segments.size(), i -> {
      InputStream segment = openSegment(b, segments.get(i), i, what);
      if (segments.get(i).get(2).asText().equals(ctx.nodeId())) {
        local[0]++;
      }
      if (i == segments.size() - 1) {
        if (local[0] == segments.size()) {
          metrics.incLocalBlocksFetched(1);
        } else {
          metrics.incRemoteBlocksFetched(1);
        }
      }
      return segment;
    }));
  }

  /** Segment {@code i} of a block, fetched from its tier and verified. */
  private InputStream openSegment(Block b, JsonNode seg, int i, String what) {
    long start = System.nanoTime();
    String tier = seg.get(0).asText();
    String node = seg.get(2).asText();
    String segWhat = "segment " + i + " (" + tier + " tier, node " + node + ") of " + what;
    byte[] frame;
    int length;
    try {
      frame = tier.equals("remote")
          ? readRemote(seg.get(3).asText(), seg.get(1).asLong(), segWhat)
          : readSegment(tier, node, seg.get(3).asText(), segWhat);
      length = SegmentCodec.verify(frame,
          SegmentCodec.identity(shuffleKey, b.mapId, b.reduceId, i), segWhat);
    } catch (IOException | RuntimeException e) {
      throw sneaky(readFailure(e, context.attemptNumber(), b.address, handle.shuffleId(),
          b.mapId, b.mapIndex, b.reduceId));
    }
    if (node.equals(ctx.nodeId())) {
      metrics.incLocalBytesRead(length);
    } else {
      metrics.incRemoteBytesRead(length);
    }
    metrics.incFetchWaitTime((System.nanoTime() - start) / 1_000_000);
    return new ByteArrayInputStream(frame, SegmentCodec.HEADER_BYTES, length);
  }

  /** A remote-tier segment, read through this node's tier manager (fsspec). */
  private byte[] readRemote(String location, long nbytes, String what) throws IOException {
    ObjectNode request = ctx.json.createObjectNode();
    request.put("shuffle", shuffleKey);
    request.put("location", location);
    request.put("nbytes", nbytes);
    request.set("config", ctx.configNode());
    byte[] frame;
    try {
      frame = ctx.callBytes(ctx.tierManager(ctx.nodeId()), "spark_read_remote",
          ctx.toJson(request));
    } catch (IOException e) {
      // The store or this node's tier manager failed to answer (unreachable, throttled,
      // timed out, restarted): the object may well be there.
      throw new SegmentUnavailableException(what + ": the remote tier could not be read "
          + "through this node's tier manager: " + e.getMessage(), e);
    }
    if (frame.length == 0) {  // the tier manager's answer for an object that is gone
      throw new IOException(what + " is gone from the remote tier (" + location + ")");
    }
    return frame;
  }

  @SuppressWarnings("unchecked")
  private byte[] readSegment(String tier, String node, String location, String what)
      throws IOException {
    if (tier.equals("memory")) {
      String object = MemoryPacking.objectLocation(location);
      byte[] bytes = takePrefetched(object);
      if (bytes == null) {
        ObjectRef<byte[]> ref;
        try {
          ref = decodeRef(object);
        } catch (IOException e) {
          throw new IOException(what + ": cannot decode its object reference", e);
        }
        boolean batchTimedOut = timedOutObjects.contains(object);
        try {
          bytes = Ray.get(ref, fetchTimeoutMs(ctx.fetchTimeoutMs, batchTimedOut));
        } catch (RayTimeoutException e) {
          throw new SegmentUnavailableException(what + " did not arrive from the memory tier "
              + "within " + ctx.fetchTimeoutMs + " ms (its node or object store is not "
              + "answering)" + (batchTimedOut ? ", fetched with other blocks' objects" : "")
              + ": " + e.getMessage(), e);
        } catch (RuntimeException e) {
          throw new IOException(what + " is gone from the memory tier (the executor that "
              + "wrote it died?): " + e.getMessage(), e);
        }
      }
      try {
        return MemoryPacking.segment(location, bytes);
      } catch (IOException e) {
        throw new IOException(what + ": " + e.getMessage(), e);
      }
    }
    if (node.equals(ctx.nodeId())) {
      try {
        return LocalSegmentFiles.read(location, ctx.spillDirs());
      } catch (NoSuchFileException e) {
        throw new IOException(what + " is gone from the disk tier (" + location + ")", e);
      } catch (LocalSegmentFiles.UnsafeSegmentPathException e) {
        throw new LocalSegmentFiles.UnsafeSegmentPathException(what + ": " + e.getMessage());
      }
    }
    byte[] bytes = readFromNode(node, location, what);
    if (bytes.length == 0) {  // the tier manager's answer for a file that is gone
      throw new IOException(what + " is gone from the disk tier of node " + node + " ("
          + location + ")");
    }
    return bytes;
  }

  /**
   * A disk segment file of another node, served by that node's tier manager. If that died
   * (Ray's memory monitor, a crash) on a node that lives, the file is still there: a tier
   * manager started again serves it (once). A node that is gone took the file with it
   * (an {@code IOException}: the map output is lost); a call that fails otherwise is a
   * {@link SegmentUnavailableException}.
   */
  private byte[] readFromNode(String node, String location, String what) throws IOException {
    Optional<PyActorHandle> owner = ctx.existingTierManager(node);
    if (owner.isPresent()) {
      try {
        return ctx.callBytes(owner.get(), "spark_read_segment", location);
      } catch (IOException e) {
        if (!HybridRayContext.isActorGone(e)) {
          if (isControlPlaneFault(e)) {
            throw new SegmentUnavailableException(what + ": node " + node + "'s tier manager "
                + "did not answer: " + e.getMessage(), e);
          }
          throw e;  // the tier manager's own error
        }
      }
    }
    if (!ctx.nodeAlive(node)) {
      throw new IOException(what + ": node " + node + " is gone, with its disk tier");
    }
    try {
      return ctx.callBytes(ctx.tierManager(node), "spark_read_segment", location);
    } catch (IOException e) {
      throw new SegmentUnavailableException(what + ": node " + node + " lives but its tier "
          + "manager, started again, did not serve it: " + e.getMessage(), e);
    }
  }

  /**
   * A segment that could not be fetched although nothing says it is gone (a call timed
   * out, a store or an actor did not answer): the reading task fails and Spark runs it
   * again, rather than a {@code FetchFailedException} making Spark recompute the outputs
   * of the block's executor.
   */
  static final class SegmentUnavailableException extends IOException {
    SegmentUnavailableException(String message, Throwable cause) {
      super(message, cause);
    }
  }

  /**
   * What a reducer throws when a segment of block ({@code address}, {@code shuffleId},
   * {@code mapId}, {@code mapIndex}, {@code reduceId}) failed to open with {@code e}.
   * A {@code FetchFailedException} only when the map output is lost (gone, damaged, its
   * node dead): Spark then drops every output of the block's executor, for every shuffle,
   * recomputes them, and gives up on the stage after 4 in a row. A segment that could not
   * be read this time ({@link SegmentUnavailableException}) fails the task's first attempt
   * ({@code taskAttempt} 0) instead, which Spark runs again; a retry that cannot read it
   * either treats it as lost, so a node that stays hung does not fail the job after
   * {@code spark.task.maxFailures} tries of the same read: Spark recomputes the map
   * elsewhere, as it did for every failed read before. An unsafe path is no lost output
   * (recomputing the map would not make the path safe).
   */
  static Throwable readFailure(Throwable e, int taskAttempt, BlockManagerId address,
      int shuffleId, long mapId, int mapIndex, int reduceId) {
    if (e instanceof LocalSegmentFiles.UnsafeSegmentPathException) {
      return e;
    }
    if (e instanceof SegmentUnavailableException && taskAttempt == 0) {
      return new IOException("hybrid_ray: " + e.getMessage()
          + " (the task is run again; a retry that cannot read it either recomputes the map)",
          e);
    }
    return new FetchFailedException(address, shuffleId, mapId, mapIndex, reduceId,
        "hybrid_ray: " + e.getMessage(), e);
  }

  /**
   * Whether a failed call to the master failed in transit (it timed out, or the actor
   * died) rather than with the master's own answer: such a failure says nothing about the
   * map outputs, so it must not blame an executor with a FetchFailedException.
   */
  static boolean isControlPlaneFault(Throwable e) {
    // A master that could not even be found is one too: blamed on the first block's
    // executor, Spark recomputed that executor's outputs for nothing.
    return HybridRayContext.causedBy(e, RayTimeoutException.class, RayActorException.class,
        HybridRayContext.MasterNotRunningException.class);
  }

  @SuppressWarnings("unchecked")
  static <E extends Throwable> RuntimeException sneaky(Throwable e) throws E {
    throw (E) e;
  }
}
