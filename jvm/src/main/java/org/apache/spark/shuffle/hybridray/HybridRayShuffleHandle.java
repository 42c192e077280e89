package org.apache.spark.shuffle.hybridray;

import org.apache.spark.ShuffleDependency;
import org.apache.spark.shuffle.BaseShuffleHandle;
import org.apache.spark.shuffle.sort.BypassMergeSortShuffleHandle;
import org.apache.spark.shuffle.sort.SerializedShuffleHandle;

/**
 * hybrid_ray's handles, one per writer path {@code SortShuffleManager} picks: Spark SQL
 * skips copying rows before a shuffle when the manager is a {@code SortShuffleManager} and
 * the bypass-merge or serialized path applies (those serialize each record at once), so
 * the same path must write here, or reused row objects would be buffered and corrupted.
 */
public class HybridRayShuffleHandle<K, V, C> extends BaseShuffleHandle<K, V, C>
    implements HybridRayHandle {
  private static final long serialVersionUID = 1L;
  private final String shuffleKey;
  private final String sessionToken;

  public HybridRayShuffleHandle(int shuffleId, ShuffleDependency<K, V, C> dependency,
      String shuffleKey, String sessionToken) {
    super(shuffleId, dependency);
    this.shuffleKey = shuffleKey;
    this.sessionToken = sessionToken;
  }

  @Override
  public String shuffleKey() {
    return shuffleKey;
  }

  @Override
  public String sessionToken() {
    return sessionToken;
  }

  /** Few reduce partitions, no map-side combine: Spark's bypass-merge writer. */
  public static class Bypass<K, V> extends BypassMergeSortShuffleHandle<K, V>
      implements HybridRayHandle {
    private static final long serialVersionUID = 1L;
    private final String shuffleKey;
    private final String sessionToken;

    public Bypass(int shuffleId, ShuffleDependency<K, V, V> dependency, String shuffleKey,
        String sessionToken) {
      super(shuffleId, dependency);
      this.shuffleKey = shuffleKey;
      this.sessionToken = sessionToken;
    }

    @Override
    public String shuffleKey() {
      return shuffleKey;
    }

    @Override
    public String sessionToken() {
      return sessionToken;
    }
  }

  /** Relocatable serializer, no aggregation: Spark's serialized (unsafe) writer. */
  public static class Serialized<K, V> extends SerializedShuffleHandle<K, V>
      implements HybridRayHandle {
    private static final long serialVersionUID = 1L;
    private final String shuffleKey;
    private final String sessionToken;

    public Serialized(int shuffleId, ShuffleDependency<K, V, V> dependency, String shuffleKey,
        String sessionToken) {
      super(shuffleId, dependency);
      this.shuffleKey = shuffleKey;
      this.sessionToken = sessionToken;
    }

    @Override
    public String shuffleKey() {
      return shuffleKey;
    }

    @Override
    public String sessionToken() {
      return sessionToken;
    }
  }
}
